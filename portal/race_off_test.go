//go:build !race

package portal

// raceBuild: the race detector is on (see race_on_test.go).
const raceBuild = false
