#!/usr/bin/env bash
# The static checks of `make lint` (and so of `make test` and CI): gofmt, go vet (also with the
# build tags of the benchmark and measurement files), staticcheck and deadcode at the versions
# pinned in hack/tools/go.mod, and the builds and vets for macOS and Windows.
# Any finding fails. Usage: hack/lint.sh (GO and BIN as in the Makefile).
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
BIN=${BIN:-bin}
# Build tags whose files must pass too (a tag no file uses costs nothing).
TAGS=bench,scalemeasure,cluster,clustermon
# Findings under paths matching PENDING are reported but do not fail (for a package being
# reworked, whose owner takes its findings). None now: '^$' matches no finding.
PENDING='^$'

fail=0
step() { printf '== %s\n' "$*"; }
report() { # report NAME OUTPUT: fail on findings outside PENDING, list those inside
	local name=$1 out=$2 bad pending
	bad=$(grep -Ev "$PENDING" <<<"$out" || true)
	pending=$(grep -E "$PENDING" <<<"$out" || true)
	if [ -n "$pending" ]; then
		printf '%s: %d finding(s) left to their owner (not failing):\n%s\n' "$name" "$(wc -l <<<"$pending")" "$pending"
	fi
	if [ -n "$bad" ]; then
		printf '%s:\n%s\n' "$name" "$bad"
		fail=1
	fi
}

step gofmt
out=$(gofmt -l $(git ls-files '*.go'))
if [ -n "$out" ]; then printf 'gofmt needed:\n%s\n' "$out"; fail=1; fi

step go vet
"$GO" vet ./... || fail=1
"$GO" vet -tags "$TAGS" ./... || fail=1

step build the checkers '(hack/tools/go.mod)'
tools=$(pwd)/$BIN/tools
(cd hack/tools && "$GO" build -o "$tools/" honnef.co/go/tools/cmd/staticcheck golang.org/x/tools/cmd/deadcode)

step staticcheck
# One run per build configuration, merged: code used only under a tag is not "unused".
out=$(printf 'default:\ntagged: -tags=%s\n' "$TAGS" | "$tools/staticcheck" -matrix ./... 2>&1 || true)
report staticcheck "$out"

step deadcode
# Production packages only (test helpers are reached by tests); with the tests as roots, so a
# function the tests alone use is not reported.
prod='^github.com/kube-userspace-proxy/kube-userspace-proxy/(cmd|deploy|iptables|loadbalancer|portal|proxy)(/[^/]+)*$'
out=$("$tools/deadcode" -test -tags "$TAGS" -filter "$prod" ./... 2>&1 | grep -Ev '^(iptables/netnstest|proxy/[a-z]+/[a-z]+test)/' || true)
report deadcode "$out"

step builds and vets for macOS and Windows
# Every package builds there, and vets (which compiles the tests too): Linux-only features sit
# in _linux files beside portable ones (the relays of proxy/forward/tcp and udp, iptables' tool,
# app's options); tests that need Linux (namespaces, iptables, the event loops) are tagged linux.
for goos in darwin windows; do
	GOOS=$goos "$GO" build ./... || fail=1
	GOOS=$goos "$GO" vet ./... || fail=1
done

exit $fail
