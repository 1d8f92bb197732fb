package portal

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"
)

// recordingFlows records DeleteUDP calls.
type recordingFlows struct{ calls []string }

func (r *recordingFlows) DeleteUDP(dst netip.Addr, port int) (int, error) {
	r.calls = append(r.calls, fmt.Sprintf("%v:%d", dst, port))
	return 1, nil
}

// Stale UDP flows are deleted for every UDP target on the first sync, then only for targets
// whose handling changed or that went away; TCP portals and failed syncs delete nothing.
func TestStaleUDPFlows(t *testing.T) {
	flows := &recordingFlows{}
	f := &fakeRunner{}
	m, err := NewManager(Options{Config: v4Config(), Runner: f, Flows: flows})
	if err != nil {
		t.Fatal(err)
	}
	dns := Portal{Comment: "kube-system/dns:dns", Protocol: "udp", Port: 53, ClusterIP: a("10.96.0.10"), ProxyPort: 40000,
		NodePort: 30053, ExternalIPs: []netip.Addr{a("192.0.2.7"), a("2001:db8::7")}}
	web := Portal{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: a("10.96.0.20"), ProxyPort: 40001}
	step := func(name string, sync func([]Portal) error, ps []Portal, want ...string) {
		t.Helper()
		flows.calls = nil
		if err := sync(ps); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		slices.Sort(flows.calls)
		slices.Sort(want)
		if !slices.Equal(flows.calls, want) {
			t.Errorf("%s: deleted flows of %v, want %v", name, flows.calls, want)
		}
	}
	step("first sync", m.Sync, []Portal{dns, web}, "10.96.0.10:53", "192.0.2.7:53", "0.0.0.0:30053")
	step("no change", m.Update, []Portal{dns, web})
	moved := dns
	moved.ProxyPort = 40002 // a new listener (say, after a protocol change)
	step("new proxy port", m.Update, []Portal{moved, web}, "10.96.0.10:53", "192.0.2.7:53", "0.0.0.0:30053")
	rejected := moved
	rejected.Internal = Reject
	step("ClusterIP now rejected", m.Sync, []Portal{rejected, web}, "10.96.0.10:53")
	step("service gone", m.Update, []Portal{web}, "10.96.0.10:53", "192.0.2.7:53", "0.0.0.0:30053")
	f.failRestore = map[string]bool{tableNAT: true}
	flows.calls = nil
	if err := m.Sync([]Portal{dns}); err == nil {
		t.Fatal("Sync with a failing restore: no error")
	}
	if len(flows.calls) != 0 {
		t.Errorf("a failed sync deleted flows: %v", flows.calls)
	}
}
