//go:build tools

// Package tools pins the versions of the static checkers `make lint` runs, apart from the
// project's own module so that they add nothing to its dependencies:
//
//	go run -modfile=hack/tools/go.mod honnef.co/go/tools/cmd/staticcheck ./...
package tools

import (
	_ "golang.org/x/tools/cmd/deadcode"
	_ "honnef.co/go/tools/cmd/staticcheck"
)
