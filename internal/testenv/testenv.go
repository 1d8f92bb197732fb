// Package testenv sorts the project's tests into tiers. The unit tier needs nothing: no root, no
// tools beyond Go, any OS. The privileged tiers need root (network namespaces, iptables, raw
// sockets), programs installed by `make deps`, or the Kubernetes binaries of `make test-bins`.
//
// A test of a privileged tier states what it needs (Privileged, Tool, Need, or Main for a
// package whose every test needs it). When that is missing, the test is skipped with a message
// naming what is missing: `go test ./...` as an ordinary user runs the unit tier and passes.
// With KUP_TEST_ALL=1 (set by `make test`, and so in CI) nothing is skipped: what is missing
// fails the test, so CI cannot pass a tier it did not run.
package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
)

// AllVar is the environment variable that makes every tier mandatory: "1" turns every skip of
// this package into a failure.
const AllVar = "KUP_TEST_ALL"

// All reports whether every tier must run (KUP_TEST_ALL=1).
func All() bool { return os.Getenv(AllVar) == "1" }

// Privileged skips t unless the process runs as root on Linux (network namespaces, iptables,
// sysctls, IP_TRANSPARENT).
func Privileged(t testing.TB) {
	t.Helper()
	need(t, missingPrivilege())
}

// Tool skips t unless every one of names is on PATH; hint says where they come from (such as
// "Debian package iptables").
func Tool(t testing.TB, hint string, names ...string) {
	t.Helper()
	need(t, missingTools(hint, names))
}

// Need skips t with reason (or fails it under KUP_TEST_ALL=1) unless reason is "". It is for
// what the other helpers do not cover, such as a cached binary.
func Need(t testing.TB, reason string) {
	t.Helper()
	need(t, reason)
}

// Requirement is something a whole package needs, for Main.
type Requirement func() string

// Root requires root on Linux.
func Root() Requirement { return missingPrivilege }

// Tools requires every one of names on PATH.
func Tools(hint string, names ...string) Requirement {
	return func() string { return missingTools(hint, names) }
}

// Main is TestMain for a package whose every test needs reqs: it returns m.Run's exit code when
// all are met, and otherwise prints why and returns 0 without running any test (under
// KUP_TEST_ALL=1 it returns 1 instead):
//
//	func TestMain(m *testing.M) { os.Exit(testenv.Main(m, testenv.Root())) }
func Main(m *testing.M, reqs ...Requirement) int {
	var missing []string
	for _, r := range reqs {
		if why := r(); why != "" {
			missing = append(missing, why)
		}
	}
	if len(missing) == 0 {
		return m.Run()
	}
	why := strings.Join(missing, "; ")
	if All() {
		fmt.Fprintf(os.Stderr, "FAIL: %s=1 and this package's tests cannot run: %s\n", AllVar, why)
		return 1
	}
	fmt.Printf("SKIP: every test of this package: %s (%s=1 makes this a failure)\n", why, AllVar)
	return 0
}

func need(t testing.TB, reason string) {
	t.Helper()
	if reason == "" {
		return
	}
	if All() {
		t.Fatalf("%s=1 and this test cannot run: %s", AllVar, reason)
		return
	}
	t.Skipf("needs %s (%s=1 makes this a failure)", reason, AllVar)
}

func missingLinux() string {
	if runtime.GOOS != "linux" {
		return "Linux (this is " + runtime.GOOS + ")"
	}
	return ""
}

func missingPrivilege() string {
	if why := missingLinux(); why != "" {
		return why
	}
	if os.Geteuid() != 0 {
		return fmt.Sprintf("root (network namespaces, iptables; running as uid %d)", os.Geteuid())
	}
	return ""
}

func missingTools(hint string, names []string) string {
	var missing []string
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			missing = append(missing, n)
		}
	}
	if len(missing) == 0 {
		return ""
	}
	s := "tools not on PATH: " + strings.Join(missing, ", ")
	if hint != "" {
		s += " (" + hint + ")"
	}
	return s
}
