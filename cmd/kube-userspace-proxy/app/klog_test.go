package app

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/rs/zerolog"
	"k8s.io/klog/v2"
)

// What client-go logs through klog comes out of the proxy's zerolog logger, as JSON here, with
// its level, component and key/value pairs.
func TestKlogRouted(t *testing.T) {
	var buf bytes.Buffer
	routeKlog(zerolog.New(&buf).Level(zerolog.InfoLevel))
	t.Cleanup(klog.ClearLogger)

	klog.ErrorS(errors.New("connection refused"), "Failed to watch", "reflector", "services")
	klog.InfoS("Caches populated", "type", "*v1.Service")
	klog.V(4).InfoS("too detailed for info level")
	klog.Flush()

	var lines []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("not a zerolog JSON line: %q: %v", l, err)
		}
		lines = append(lines, m)
	}
	if len(lines) != 2 {
		t.Fatalf("got %d lines, want 2 (the V(4) message filtered):\n%s", len(lines), buf.String())
	}
	want := []map[string]any{
		{"level": "error", "component": "client-go", "error": "connection refused", "message": "Failed to watch", "reflector": "services"},
		{"level": "info", "component": "client-go", "message": "Caches populated", "type": "*v1.Service"},
	}
	for i, w := range want {
		for k, v := range w {
			if lines[i][k] != v {
				t.Errorf("line %d: %s = %v, want %v (line %v)", i, k, lines[i][k], v, lines[i])
			}
		}
	}
}
