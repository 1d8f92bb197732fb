package app

import (
	"net/netip"
	"os"
	"reflect"
	"runtime/debug"
	"testing"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal"
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

// TestPortalSetOptions: the portals get the flags' meaning, --iptables-localhost-nodeports
// negated into NoLocalhostNodePorts.
func TestPortalSetOptions(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want portal.SetOptions
	}{
		{name: "defaults: NodePorts on 127.0.0.1", want: portal.SetOptions{BindAddress: netip.IPv4Unspecified()}},
		{name: "--iptables-localhost-nodeports=false", args: []string{"--iptables-localhost-nodeports=false"},
			want: portal.SetOptions{BindAddress: netip.IPv4Unspecified(), NoLocalhostNodePorts: true}},
		{name: "addresses", args: []string{"--bind-address=10.0.0.1", "--nodeport-addresses=10.0.0.0/24", "--cluster-cidr=10.244.0.0/16"},
			want: portal.SetOptions{BindAddress: netip.MustParseAddr("10.0.0.1"), NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24")},
				ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := parse(t, tt.args...)
			if err != nil {
				t.Fatal(err)
			}
			v, err := o.Validate()
			if err != nil {
				t.Fatal(err)
			}
			got := portalSetOptions(o, v, true, zerolog.Nop())
			tt.want.Successor, tt.want.Log = true, zerolog.Nop()
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}
