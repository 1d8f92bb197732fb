package loadbalancer

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

const thisZone = "zone-a"

// zones returns e hinted for the zones.
func zones(e proxy.Endpoint, z ...string) proxy.Endpoint {
	e.ZoneHints = proxy.NewHints(z...)
	return e
}

// nodes returns e hinted for the nodes.
func nodes(e proxy.Endpoint, n ...string) proxy.Endpoint {
	e.NodeHints = proxy.NewHints(n...)
	return e
}

func topologyRequest(t proxy.Topology) func(*proxy.ServicePort) {
	return func(sp *proxy.ServicePort) { sp.Topology = t }
}

// TestTopology checks which endpoints topology hints leave to each traffic class, through Usable
// and through Next (which must rotate over exactly what Usable returns), as kube-proxy's
// CategorizeEndpoints would for this node (thisNode in thisZone).
func TestTopology(t *testing.T) {
	svc := name("web", "http")
	a1, a2 := "10.0.0.1", "10.0.0.2" // zone-a, remote nodes
	b1, b2 := "10.0.1.1", "10.0.1.2" // zone-b
	l1 := "10.0.2.1"                 // on thisNode (zone-a)
	tests := []struct {
		name     string
		zone     string // this node's zone; thisZone unless set to "-" (unknown)
		nodeName string // this node's name; thisNode unless set to "-" (unknown)
		spOpts   []func(*proxy.ServicePort)
		eps      []proxy.Endpoint
		external bool
		want     []string // usable addresses, in eps order
		wantErr  error
	}{
		{
			name: "zone hints: only this zone's endpoints",
			eps:  []proxy.Endpoint{zones(ready(a1, "n2"), "zone-a"), zones(ready(b1, "n3"), "zone-b"), zones(ready(a2, "n4"), "zone-a")},
			want: []string{a1, a2},
		},
		{
			name:   "service asks (Auto): same as when it does not",
			spOpts: []func(*proxy.ServicePort){topologyRequest(proxy.TopologyAuto)},
			eps:    []proxy.Endpoint{zones(ready(a1, "n2"), "zone-a"), zones(ready(b1, "n3"), "zone-b")},
			want:   []string{a1},
		},
		{
			name: "endpoint hinted for several zones",
			eps:  []proxy.Endpoint{zones(ready(a1, "n2"), "zone-b", "zone-a"), zones(ready(b1, "n3"), "zone-b")},
			want: []string{a1},
		},
		{
			name: "zone unknown: hints ignored",
			zone: "-",
			eps:  []proxy.Endpoint{zones(ready(a1, "n2"), "zone-a"), zones(ready(b1, "n3"), "zone-b")},
			want: []string{a1, b1},
		},
		{
			name: "a ready endpoint without hints: hints ignored",
			eps:  []proxy.Endpoint{zones(ready(a1, "n2"), "zone-a"), ready(b1, "n3"), zones(ready(b2, "n3"), "zone-b")},
			want: []string{a1, b1, b2},
		},
		{
			name: "no endpoint for this zone: hints ignored",
			eps:  []proxy.Endpoint{zones(ready(b1, "n3"), "zone-b"), zones(ready(b2, "n3"), "zone-b")},
			want: []string{b1, b2},
		},
		{
			name: "only ready endpoints count: an unhinted not-ready one does not stop hints",
			eps:  []proxy.Endpoint{zones(ready(a1, "n2"), "zone-a"), zones(ready(b1, "n3"), "zone-b"), notReady(a2, "n2")},
			want: []string{a1},
		},
		{
			name: "only ready endpoints count: a terminating one hinted for this zone does not enable hints",
			eps:  []proxy.Endpoint{zones(ready(b1, "n3"), "zone-b"), zones(ready(b2, "n3"), "zone-b"), zones(terminating(a1, "n2"), "zone-a")},
			want: []string{b1, b2},
		},
		{
			name: "no ready endpoint: the terminating fallback ignores hints",
			eps:  []proxy.Endpoint{zones(terminating(a1, "n2"), "zone-a"), zones(terminating(b1, "n3"), "zone-b")},
			want: []string{a1, b1},
		},
		{
			name: "node hints: only endpoints hinted for this node, over zone hints",
			eps: []proxy.Endpoint{
				nodes(zones(ready(l1, thisNode), "zone-a"), thisNode),
				nodes(zones(ready(a1, "n2"), "zone-a"), "n2"),
				nodes(zones(ready(b1, "n3"), "zone-b"), "n3"),
			},
			want: []string{l1},
		},
		{
			name: "node hints, none for this node: zone hints",
			eps: []proxy.Endpoint{
				nodes(zones(ready(a1, "n2"), "zone-a"), "n2"),
				nodes(zones(ready(b1, "n3"), "zone-b"), "n3"),
			},
			want: []string{a1},
		},
		{
			name: "node hints on some endpoints only: zone hints",
			eps: []proxy.Endpoint{
				nodes(zones(ready(l1, thisNode), "zone-a"), thisNode),
				zones(ready(a1, "n2"), "zone-a"),
				zones(ready(b1, "n3"), "zone-b"),
			},
			want: []string{l1, a1},
		},
		{
			name: "node hints, none for this node, no zone hints: every endpoint",
			eps:  []proxy.Endpoint{nodes(ready(a1, "n2"), "n2"), nodes(ready(b1, "n3"), "n3")},
			want: []string{a1, b1},
		},
		{
			name:     "node hints with the node name unknown: zone hints",
			nodeName: "-",
			eps: []proxy.Endpoint{
				nodes(zones(ready(l1, ""), "zone-a"), thisNode),
				nodes(zones(ready(b1, "n3"), "zone-b"), "n3"),
			},
			want: []string{l1},
		},
		{
			name: "node hints with the zone unknown",
			zone: "-",
			eps: []proxy.Endpoint{
				nodes(zones(ready(l1, thisNode), "zone-a"), thisNode),
				nodes(zones(ready(b1, "n3"), "zone-b"), "n3"),
			},
			want: []string{l1},
		},
		{
			name:   "internal Local: ClusterIP traffic ignores hints",
			spOpts: []func(*proxy.ServicePort){internalLocal},
			eps:    []proxy.Endpoint{zones(ready(l1, thisNode), "zone-b"), zones(ready(a1, "n2"), "zone-a")},
			want:   []string{l1},
		},
		{
			name:    "internal Local: no local endpoint is no endpoint, hints or not",
			spOpts:  []func(*proxy.ServicePort){internalLocal},
			eps:     []proxy.Endpoint{zones(ready(a1, "n2"), "zone-a")},
			wantErr: ErrNoLocalEndpoints,
		},
		{
			name:     "internal Local: external traffic follows hints",
			spOpts:   []func(*proxy.ServicePort){internalLocal},
			eps:      []proxy.Endpoint{zones(ready(l1, thisNode), "zone-b"), zones(ready(a1, "n2"), "zone-a")},
			external: true,
			want:     []string{a1},
		},
		{
			name:     "external Local: external traffic ignores hints",
			spOpts:   []func(*proxy.ServicePort){externalLocal},
			eps:      []proxy.Endpoint{zones(ready(l1, thisNode), "zone-b"), zones(ready(a1, "n2"), "zone-a")},
			external: true,
			want:     []string{l1},
		},
		{
			name:   "external Local: ClusterIP traffic follows hints",
			spOpts: []func(*proxy.ServicePort){externalLocal},
			eps:    []proxy.Endpoint{zones(ready(l1, thisNode), "zone-b"), zones(ready(a1, "n2"), "zone-a")},
			want:   []string{a1},
		},
		{
			name:     "external Local: local terminating fallback, hints irrelevant",
			spOpts:   []func(*proxy.ServicePort){externalLocal},
			eps:      []proxy.Endpoint{zones(terminating(l1, thisNode), "zone-b"), zones(ready(a1, "n2"), "zone-a")},
			external: true,
			want:     []string{l1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			node := Node{Name: thisNode, Zone: thisZone}
			if tt.zone == "-" {
				node.Zone = ""
			}
			if tt.nodeName == "-" {
				node.Name = ""
			}
			sp := svcPort(svc, tt.spOpts...)
			var want []netip.AddrPort
			for _, s := range tt.want {
				want = append(want, ap(s))
			}
			if got := addrs(Usable(sp, tt.eps, node, tt.external)); !slices.Equal(got, want) {
				t.Errorf("Usable = %v, want %v", got, want)
			}
			for _, affinity := range []bool{false, true} {
				opts := tt.spOpts
				if affinity {
					opts = append(slices.Clone(opts), withAffinity(time.Hour))
				}
				lb := New(Options{NodeName: node.Name, Zone: node.Zone, Rand: rand.New(rand.NewPCG(8, 8))})
				lb.SetServicePort(svcPort(svc, opts...), tt.eps)
				if tt.wantErr != nil {
					if _, err := lb.Next(svc, clientAddr("192.168.1.1"), tt.external, false); !errors.Is(err, tt.wantErr) {
						t.Errorf("affinity=%v: Next error = %v, want %v", affinity, err, tt.wantErr)
					}
					continue
				}
				var picks []netip.AddrPort
				for i := range 3 * len(want) {
					client := netip.AddrFrom4([4]byte{192, 168, 3, byte(i)})
					ep, err := lb.Next(svc, client, tt.external, false)
					if err != nil {
						t.Fatalf("affinity=%v: Next: %v", affinity, err)
					}
					picks = append(picks, ep.Addr)
				}
				if err := checkRotation(picks, want); err != nil {
					t.Errorf("affinity=%v: %v", affinity, err)
				}
			}
		})
	}
}

// TestSetZone checks that a zone learnt, changed or lost later re-applies the hints of ports
// already set, and that a client's affinity follows: its endpoint is not used while outside the
// usable set.
func TestSetZone(t *testing.T) {
	svc, local := name("web", "http"), name("local", "http")
	a1, b1, b2 := "10.0.0.1", "10.0.1.1", "10.0.1.2"
	eps := []proxy.Endpoint{zones(ready(a1, "n2"), "zone-a"), zones(ready(b1, "n3"), "zone-b"), zones(ready(b2, "n4"), "zone-b")}
	h := newHarness(t, thisNode, 9)
	h.set(svcPort(svc, withAffinity(time.Hour)), eps...)
	h.set(svcPort(local, internalLocal), zones(ready(a1, thisNode), "zone-b"))

	clients := 0 // each check uses new clients, so that affinity does not pin them
	check := func(what string, want ...string) {
		t.Helper()
		var w []netip.AddrPort
		for _, s := range want {
			w = append(w, ap(s))
		}
		var picks []netip.AddrPort
		for range 3 * len(w) {
			clients++
			picks = append(picks, h.next(svc, netip.AddrFrom4([4]byte{192, 168, 4, byte(clients)}).String(), false, false).Addr)
		}
		if err := checkRotation(picks, w); err != nil {
			t.Errorf("%s: %v", what, err)
		}
	}
	check("zone unknown", a1, b1, b2)
	// A client pinned to a zone-b endpoint before the zone is known.
	var pinned string
	for i := range 10 {
		c := netip.AddrFrom4([4]byte{192, 168, 5, byte(i)}).String()
		if e := h.next(svc, c, false, false); e.Addr != ap(a1) {
			pinned = c
			break
		}
	}
	if pinned == "" {
		t.Fatal("no client got a zone-b endpoint")
	}

	h.lb.SetZone("zone-a")
	check("zone-a", a1)
	if e := h.next(svc, pinned, false, false); e.Addr != ap(a1) {
		t.Errorf("client pinned to a zone-b endpoint got %v in zone-a, want %v", e.Addr, a1)
	}
	if e := h.next(local, "192.168.1.1", false, false); e.Addr != ap(a1) {
		t.Errorf("internal Local port: got %v, want its local endpoint", e.Addr)
	}

	h.lb.SetZone("zone-b")
	check("zone-b", b1, b2)
	h.lb.SetZone("zone-c") // no endpoint for it
	check("zone-c", a1, b1, b2)
	h.lb.SetZone("")
	check("zone lost", a1, b1, b2)

	// Endpoints set after SetZone use the new zone too.
	h.lb.SetZone("zone-a")
	h.set(svcPort(svc), append(eps, zones(ready("10.0.0.2", "n5"), "zone-a"))...)
	check("endpoint added in zone-a", a1, "10.0.0.2")
}

// TestTopologyLog checks the debug log that says why hints are used or ignored: once per
// change of the decision, and nothing for ports that neither ask for topology nor have hints.
func TestTopologyLog(t *testing.T) {
	var buf bytes.Buffer
	lb := New(Options{NodeName: thisNode, Log: zerolog.New(&buf).Level(zerolog.DebugLevel), Rand: rand.New(rand.NewPCG(1, 1))})
	lines := func() []string {
		s := strings.TrimSpace(buf.String())
		buf.Reset()
		if s == "" {
			return nil
		}
		return strings.Split(s, "\n")
	}
	expect := func(what string, want ...string) {
		t.Helper()
		got := lines()
		if len(got) != len(want) {
			t.Fatalf("%s: logged %q, want %d lines containing %q", what, got, len(want), want)
		}
		for i := range want {
			if !strings.Contains(got[i], want[i]) {
				t.Errorf("%s: line %q does not contain %q", what, got[i], want[i])
			}
		}
	}

	plain := svcPort(name("plain", "http"))
	lb.SetServicePort(plain, []proxy.Endpoint{ready("10.0.9.1", "n2")})
	expect("plain service")

	svc := name("web", "http")
	asks := svcPort(svc, topologyRequest(proxy.TopologyPreferSameZone))
	hinted := []proxy.Endpoint{zones(ready("10.0.0.1", "n2"), "zone-a"), zones(ready("10.0.1.1", "n3"), "zone-b")}
	lb.SetServicePort(asks, []proxy.Endpoint{ready("10.0.0.1", "n2")})
	expect("asks, no hints yet", "no ready endpoint has hints")
	lb.SetServicePort(asks, hinted)
	expect("zone unknown", "zone is unknown")
	lb.SetServicePort(asks, hinted)
	expect("same again")
	lb.SetZone("zone-c")
	expect("zone without endpoints", "no endpoint is hinted for this node's zone")
	lb.SetZone("zone-a")
	expect("zone-a", `"topology: using zone hints"`)
	lb.SetServicePort(asks, append(slices.Clone(hinted), ready("10.0.2.1", "n4")))
	expect("unhinted endpoint added", "some ready endpoints have none")
	lb.SetServicePort(svcPort(svc, topologyRequest(proxy.TopologyPreferSameNode)),
		[]proxy.Endpoint{nodes(hinted[0], "n2"), nodes(hinted[1], "n3")})
	expect("node hints elsewhere", "using zone hints (ignored node hints: no endpoint is hinted for this node)")
	lb.SetServicePort(svcPort(svc, internalLocal, externalLocal), hinted)
	expect("both Local", "both traffic policies are Local")
	lb.SetServicePort(svcPort(svc), []proxy.Endpoint{ready("10.0.0.1", "n2")})
	expect("neither asked nor hinted any more", "no topology hints: every endpoint used")
}
