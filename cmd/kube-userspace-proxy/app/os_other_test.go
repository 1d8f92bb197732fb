//go:build !linux

package app

import (
	"strings"
	"testing"
	"time"
)

// TestValidateOtherOS: off Linux the defaults with --portal-mode none pass, and each option that
// needs Linux is refused with a message that says so.
func TestValidateOtherOS(t *testing.T) {
	o := NewOptions()
	o.PortalMode = PortalModeNone
	if _, err := o.Validate(); err != nil {
		t.Fatalf("defaults with --portal-mode none: %v", err)
	}
	for name, tc := range map[string]struct {
		set  func(*Options)
		want string
	}{
		"portal mode iptables": {func(o *Options) { o.PortalMode = PortalModeIPTables }, "--portal-mode none"},
		"hand-over socket":     {func(o *Options) { o.HandoverSocket = "/tmp/h.sock" }, "--handover-socket"},
		"conntrack sysctl":     {func(o *Options) { o.ConntrackUDPTimeout = time.Minute }, "--conntrack-udp-timeout"},
	} {
		t.Run(name, func(t *testing.T) {
			o := NewOptions()
			o.PortalMode = PortalModeNone
			tc.set(o)
			_, err := o.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), notOnThisOS) {
				t.Errorf("Validate: %v; want an error naming %s and saying %q", err, tc.want, notOnThisOS)
			}
		})
	}
}
