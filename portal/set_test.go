package portal

import (
	"bytes"
	"context"
	"errors"
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
	out, conflicts := claimExternal(in)
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
