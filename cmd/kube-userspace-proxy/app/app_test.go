package app

import (
	"os"
	"runtime/debug"
	"testing"
)

// steadyGC sets the collector's target unless GOGC says otherwise.
func TestSteadyGC(t *testing.T) {
	prev := debug.SetGCPercent(100)
	t.Cleanup(func() { debug.SetGCPercent(prev) })
	t.Run("GOGC set", func(t *testing.T) {
		t.Setenv("GOGC", "100")
		if _, set := steadyGC(); set {
			t.Error("steadyGC changed the target with GOGC set")
		}
		if got := debug.SetGCPercent(100); got != 100 {
			t.Errorf("target %d after steadyGC with GOGC=100, want 100", got)
		}
	})
	t.Run("GOGC unset", func(t *testing.T) {
		t.Setenv("GOGC", "")
		os.Unsetenv("GOGC")
		if gc, set := steadyGC(); !set || gc != steadyGCPercent {
			t.Errorf("steadyGC() = %d, %v; want %d, true", gc, set, steadyGCPercent)
		}
		if got := debug.SetGCPercent(100); got != steadyGCPercent {
			t.Errorf("target %d after steadyGC, want %d", got, steadyGCPercent)
		}
	})
}
