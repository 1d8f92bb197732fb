package portal

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// fakeRouting records the calls enableTransparent makes.
type fakeRouting struct {
	enableErr, cleanupErr error
	enabled, cleaned      int
}

func (f *fakeRouting) EnableTransparent(context.Context) error {
	f.enabled++
	return f.enableErr
}

func (f *fakeRouting) CleanupTransparent(context.Context) error {
	f.cleaned++
	return f.cleanupErr
}

func TestEnableTransparent(t *testing.T) {
	for _, tc := range []struct {
		name        string
		routing     fakeRouting
		want        bool
		wantCleaned int
		wantLog     []string
	}{
		{name: "enabled", want: true},
		{
			name:        "the kernel refuses: serve without, remove the partial routing",
			routing:     fakeRouting{enableErr: errors.New("mangle: no xt_socket")},
			wantCleaned: 1,
			wantLog:     []string{"transparent connections disabled", "no xt_socket"},
		},
		{
			name:        "the cleanup fails too: both logged",
			routing:     fakeRouting{enableErr: errors.New("no xt_socket"), cleanupErr: errors.New("ip rule busy")},
			wantCleaned: 1,
			wantLog:     []string{"transparent connections disabled", "removing the partly programmed routing", "ip rule busy"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			r := tc.routing
			got := enableTransparent(context.Background(), &r, zerolog.New(&buf))
			if got != tc.want || r.enabled != 1 || r.cleaned != tc.wantCleaned {
				t.Errorf("enableTransparent = %v (enable called %d, cleanup %d), want %v (1, %d)", got, r.enabled, r.cleaned, tc.want, tc.wantCleaned)
			}
			for _, s := range tc.wantLog {
				if !strings.Contains(buf.String(), s) {
					t.Errorf("log lacks %q:\n%s", s, buf.String())
				}
			}
			if tc.want && buf.Len() != 0 {
				t.Errorf("logged on success:\n%s", buf.String())
			}
		})
	}
}

// toPortals: a service port has portals in the families of its ClusterIPs; in a family it has no
// ClusterIP of, its listener (which listens on every address of both families when the bind
// address is unspecified) still gets a portal that guards the proxy port and captures nothing.
func TestToPortals(t *testing.T) {
	v4only := &proxy.ServicePort{
		Name: proxy.Name{Namespace: "default", Name: "web", Port: "http"}, Protocol: v1.ProtocolTCP, Port: 80, NodePort: 30080,
		ClusterIPs: []netip.Addr{a("10.96.0.10")}, ExternalIPs: []netip.Addr{a("192.0.2.7"), a("2001:db8::7")},
		LoadBalancerIPs: []netip.Addr{a("203.0.113.1")},
	}
	closed := &proxy.ServicePort{Name: proxy.Name{Namespace: "default", Name: "closed"}, Protocol: v1.ProtocolUDP, Port: 53,
		ClusterIPs: []netip.Addr{a("10.96.0.53")}}
	ports := []proxy.PortState{
		{ServicePort: v4only, ProxyPort: 38023, External: proxy.Drop},
		{ServicePort: closed, ProxyPort: 0, Internal: proxy.Reject, External: proxy.Reject},
	}
	v4 := toPortals(iptables.IPv4, ports)
	want4 := []Portal{
		{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: a("10.96.0.10"), NodePort: 30080, ProxyPort: 38023,
			ExternalIPs: v4only.ExternalIPs, LoadBalancerIPs: v4only.LoadBalancerIPs, External: proxy.Drop},
		{Comment: "default/closed:", Protocol: "udp", Port: 53, ClusterIP: a("10.96.0.53"), Internal: proxy.Reject, External: proxy.Reject},
	}
	if !slices.EqualFunc(v4, want4, portalEqual) {
		t.Errorf("IPv4 portals:\n got %+v\nwant %+v", v4, want4)
	}
	v6 := toPortals(iptables.IPv6, ports)
	want6 := []Portal{{Comment: "default/web:http", Protocol: "tcp", Port: 80, ProxyPort: 38023, External: proxy.Drop}}
	if !slices.EqualFunc(v6, want6, portalEqual) {
		t.Errorf("IPv6 portals:\n got %+v\nwant %+v", v6, want6)
	}
	// The guard-only portal renders the proxy port's guard and nothing else.
	nat, filter := Render(v6Config(), Host{}, v6)
	if want := natDecl + natJumps; string(nat) != want {
		t.Errorf("IPv6 nat:\n%s\nwant declarations only", nat)
	}
	wantFilter := filterDecl + guardRule("", "tcp", "38023") + "\n" + filterJumps
	if string(filter) != wantFilter {
		t.Errorf("IPv6 filter:\n%s\nwant:\n%s", filter, wantFilter)
	}
}

// loadBalancerSourceRanges reach each family's portal as kube-proxy reads them: the family's own
// ranges; none (every source) when the service has only the other family's; and a list of
// nothing but unparsable entries stays closed in both.
func TestToPortalsSourceRanges(t *testing.T) {
	port := func(ranges ...netip.Prefix) []proxy.PortState {
		return []proxy.PortState{{ProxyPort: 38023, ServicePort: &proxy.ServicePort{
			Name: proxy.Name{Namespace: "default", Name: "web"}, Protocol: v1.ProtocolTCP, Port: 80,
			ClusterIPs: []netip.Addr{a("10.96.0.10"), a("fd00::10")}, LoadBalancerIPs: []netip.Addr{a("203.0.113.1"), a("2001:db8::1")},
			LoadBalancerSourceRanges: ranges,
		}}}
	}
	for _, tc := range []struct {
		name         string
		ranges       []netip.Prefix
		want4, want6 []netip.Prefix
	}{
		{name: "none"},
		{name: "both families", ranges: []netip.Prefix{pfx("198.51.100.0/24"), pfx("2001:db8:5::/48"), {}},
			want4: []netip.Prefix{pfx("198.51.100.0/24")}, want6: []netip.Prefix{pfx("2001:db8:5::/48")}},
		{name: "IPv4 only: IPv6 open, as with kube-proxy", ranges: []netip.Prefix{pfx("198.51.100.0/24")},
			want4: []netip.Prefix{pfx("198.51.100.0/24")}},
		{name: "only bad entries: closed in both", ranges: []netip.Prefix{{}, {}},
			want4: []netip.Prefix{{}, {}}, want6: []netip.Prefix{{}, {}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, f := range []struct {
				fam  iptables.Family
				want []netip.Prefix
			}{{iptables.IPv4, tc.want4}, {iptables.IPv6, tc.want6}} {
				got := toPortals(f.fam, port(tc.ranges...))
				if len(got) != 1 || !slices.Equal(got[0].LoadBalancerSourceRanges, f.want) {
					t.Errorf("%v: portals %+v, want source ranges %v", f.fam, got, f.want)
				}
			}
		})
	}
}

// TestClaimExternal: an external or load-balancer IP:port two service ports share goes to the
// first by name only, whatever changed last, so full and partial syncs agree on the winner; the
// other protocol's port is no conflict.
func TestClaimExternal(t *testing.T) {
	ip := netip.MustParseAddr("192.0.2.7")
	mk := func(name, proto string) Portal {
		return Portal{Comment: name, Protocol: proto, Port: 80, ClusterIP: netip.MustParseAddr("10.96.0.1"), ProxyPort: 40000,
			ExternalIPs: []netip.Addr{ip, netip.MustParseAddr("192.0.2.8")}, LoadBalancerIPs: []netip.Addr{ip}}
	}
	in := []Portal{mk("ns/a:http", "tcp"), mk("ns/b:http", "tcp"), mk("ns/c:dns", "udp")}
	was := slices.Clone(in)
	out, conflicts := claimExternal(in)
	if !slices.EqualFunc(in, was, portalEqual) {
		t.Errorf("claimExternal modified its input (the Set's cached portals): %+v", in)
	}
	if noConflict := []Portal{in[0], in[2]}; !slicesSame(first(claimExternal(noConflict)), noConflict) {
		t.Errorf("claimExternal copied portals without a conflict")
	}
	if got := out[0].ExternalIPs; len(got) != 2 || len(out[0].LoadBalancerIPs) != 1 {
		t.Errorf("a: external %v, LB %v; want all its addresses", got, out[0].LoadBalancerIPs)
	}
	if got := out[1].ExternalIPs; len(got) != 0 || len(out[1].LoadBalancerIPs) != 0 {
		t.Errorf("b: external %v, LB %v; want none (a has them)", got, out[1].LoadBalancerIPs)
	}
	if got := out[2].ExternalIPs; len(got) != 2 {
		t.Errorf("c (UDP): external %v, want both", got)
	}
	if len(conflicts) != 3 || !strings.Contains(conflicts[0], "ns/b:http") || !strings.Contains(conflicts[0], "ns/a:http") {
		t.Errorf("conflicts %q, want 3, naming b and a", conflicts)
	}
	// The rendered rules hold 192.0.2.7:80/tcp for a only.
	nat, _ := Render(Config{Family: iptables.IPv4, HostIP: netip.MustParseAddr("10.0.0.11")}, Host{}, out)
	for _, line := range strings.Split(string(nat), "\n") {
		if strings.Contains(line, "192.0.2.7/32") && strings.Contains(line, "-p tcp") && !strings.Contains(line, "ns/a:http") {
			t.Errorf("a rule for the shared address of another service port: %s", line)
		}
	}
}

func first[A, B any](a A, _ B) A { return a }

// slicesSame reports whether a and b are the same slice (not only equal elements).
func slicesSame[T any](a, b []T) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

// TestPortalCache: the portals of a sync built with the last sync's (portalCache) are the ones
// built from scratch, whatever changed in between (ports added, removed, redefined, their proxy
// ports and actions changed; random steps in both families); the same slice of states gives
// the same portals without allocating, and an equal one only the new list.
func TestPortalCache(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	sp := func(i int) *proxy.ServicePort {
		p := &proxy.ServicePort{Name: proxy.Name{Namespace: fmt.Sprintf("ns%d", i%3), Name: fmt.Sprintf("svc%d", i/3), Port: "p"},
			Protocol: v1.ProtocolTCP, Port: 80}
		switch r.IntN(5) {
		case 0: // no ClusterIP: a guard-only portal in both families while its listener is open
		case 1:
			p.ClusterIPs = []netip.Addr{netip.AddrFrom16([16]byte{0xfd, 15: byte(i)})}
		default:
			p.ClusterIPs = []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)})}
			p.Protocol = []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP, v1.ProtocolSCTP}[r.IntN(3)]
			if r.IntN(4) == 0 {
				p.LoadBalancerIPs = []netip.Addr{a("203.0.113.1")} // shared: claimExternal's conflicts
				p.LoadBalancerSourceRanges = []netip.Prefix{pfx("198.51.100.0/24"), pfx("2001:db8::/32")}
			}
		}
		return p
	}
	state := func(i int) proxy.PortState {
		st := proxy.PortState{ServicePort: sp(i), ProxyPort: 30000 + r.IntN(3)}
		if r.IntN(4) == 0 {
			st.ProxyPort, st.Internal, st.External = 0, proxy.Reject, proxy.Reject
		}
		return st
	}
	byName := func(ports []proxy.PortState) {
		slices.SortFunc(ports, func(a, b proxy.PortState) int {
			return strings.Compare(a.ServicePort.Name.String(), b.ServicePort.Name.String())
		})
	}
	present := map[int]proxy.PortState{}
	caches := map[iptables.Family]*portalCache{iptables.IPv4: {}, iptables.IPv6: {}}
	var ports []proxy.PortState
	for step := range 300 {
		if step%7 != 6 { // every 7th step hands over the same slice again
			for range 1 + r.IntN(3) {
				i := r.IntN(40)
				switch _, ok := present[i]; {
				case ok && r.IntN(3) == 0:
					delete(present, i)
				case ok && r.IntN(2) == 0:
					st := present[i]
					st.ProxyPort, st.Internal = 30000+r.IntN(3), proxy.Action(r.IntN(3))
					present[i] = st
				default:
					present[i] = state(i)
				}
			}
			ports = slices.Collect(maps.Values(present))
			byName(ports)
		}
		for fam, c := range caches {
			got, want := c.toPortals(fam, ports), toPortals(fam, ports)
			if !slices.EqualFunc(got, want, portalEqual) {
				t.Fatalf("step %d, %v: cached portals\n%+v\nwant\n%+v", step, fam, got, want)
			}
			claimed, _ := claimExternal(got)
			if again := c.toPortals(fam, ports); !slicesSame(again, got) || !slices.EqualFunc(again, want, portalEqual) {
				t.Fatalf("step %d, %v: the same states again gave other portals (claimed %+v)", step, fam, claimed)
			}
		}
	}

	// 1,000 unchanged ports: the same slice costs nothing, an equal one the list only.
	present = map[int]proxy.PortState{}
	for i := range 1000 {
		present[i] = state(i)
	}
	ports = slices.Collect(maps.Values(present))
	byName(ports)
	other := slices.Clone(ports)
	var c portalCache
	c.toPortals(iptables.IPv4, ports)
	if n := testing.AllocsPerRun(10, func() { c.toPortals(iptables.IPv4, ports) }); n != 0 {
		t.Errorf("the same states: %v allocations, want 0", n)
	}
	flip := false
	if n := testing.AllocsPerRun(10, func() {
		flip = !flip
		if flip {
			c.toPortals(iptables.IPv4, other)
		} else {
			c.toPortals(iptables.IPv4, ports)
		}
	}); n != 1 {
		t.Errorf("equal states: %v allocations, want 1 (the list)", n)
	}
}
