//go:build linux

package forward

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

func TestRaiseFileLimit(t *testing.T) {
	var orig syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &orig); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Lowering is always allowed; restore the limits the test started with.
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &orig); err != nil {
			t.Errorf("restoring RLIMIT_NOFILE: %v", err)
		}
	})
	low := syscall.Rlimit{Cur: 256, Max: orig.Max}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	got, err := RaiseFileLimit()
	if err != nil {
		t.Fatalf("RaiseFileLimit: %v", err)
	}
	var now syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &now); err != nil {
		t.Fatal(err)
	}
	// With CAP_SYS_RESOURCE a hard limit below MinFileLimit is raised too; without it (as in
	// some containers, even as root) the soft limit goes to the hard limit.
	want := orig.Max
	if hasCapSysResource(t) {
		want = max(orig.Max, MinFileLimit)
	}
	if got != want || now.Cur != want || now.Max < want {
		t.Errorf("RaiseFileLimit = %d, limits now %d/%d; want soft %d", got, now.Cur, now.Max, want)
	}
}

// hasCapSysResource reports whether CAP_SYS_RESOURCE is in the process's effective capabilities.
func hasCapSysResource(t *testing.T) bool {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(status), "\n") {
		if hex, ok := strings.CutPrefix(l, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(hex), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return caps&(1<<unix.CAP_SYS_RESOURCE) != 0
		}
	}
	t.Fatal("no CapEff in /proc/self/status")
	return false
}
