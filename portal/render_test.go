package portal

import (
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
)

const (
	natDecl = ":KUBE-PORTALS-CONTAINER - [0:0]\n:KUBE-PORTALS-HOST - [0:0]\n:KUBE-NODEPORT-CONTAINER - [0:0]\n:KUBE-NODEPORT-HOST - [0:0]\n" +
		":KUBE-PORTALS-CONTAINER-NEW - [0:0]\n:KUBE-PORTALS-HOST-NEW - [0:0]\n:KUBE-NODEPORT-CONTAINER-NEW - [0:0]\n:KUBE-NODEPORT-HOST-NEW - [0:0]\n"
	filterDecl = ":KUBE-NODEPORT-NON-LOCAL - [0:0]\n:KUBE-PORTALS-FILTER - [0:0]\n:KUBE-PORTALS-PROXY-PORTS - [0:0]\n" +
		":KUBE-NODEPORT-NON-LOCAL-NEW - [0:0]\n:KUBE-PORTALS-FILTER-NEW - [0:0]\n"
	// natJumps and filterJumps end every render: each chain of portal rules jumps to its recent
	// chain.
	natJumps = "-A KUBE-PORTALS-CONTAINER -j KUBE-PORTALS-CONTAINER-NEW\n-A KUBE-PORTALS-HOST -j KUBE-PORTALS-HOST-NEW\n" +
		"-A KUBE-NODEPORT-CONTAINER -j KUBE-NODEPORT-CONTAINER-NEW\n-A KUBE-NODEPORT-HOST -j KUBE-NODEPORT-HOST-NEW\n"
	filterJumps = "-A KUBE-NODEPORT-NON-LOCAL -j KUBE-NODEPORT-NON-LOCAL-NEW\n-A KUBE-PORTALS-FILTER -j KUBE-PORTALS-FILTER-NEW\n"
)

var (
	a   = netip.MustParseAddr
	pfx = netip.MustParsePrefix
)

func v4Config() Config { return Config{Family: iptables.IPv4, HostIP: a("10.0.0.5")} }
func v6Config() Config { return Config{Family: iptables.IPv6, HostIP: a("fd00::5")} }

func TestRender(t *testing.T) {
	web := Portal{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: a("10.96.0.10"), ProxyPort: 38023}
	// webGuard refuses what no portal redirected to web's proxy port.
	webGuard := guardRule("", "tcp", "38023")
	tests := []struct {
		name    string
		cfg     Config
		host    Host
		portals []Portal
		nat     []string
		filter  []string
	}{
		{
			name: "no portals: declarations only",
			cfg:  v4Config(),
		},
		{
			name:    "ClusterIP",
			cfg:     v4Config(),
			portals: []Portal{web},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				webGuard,
			},
		},
		{
			name: "multi-port service and several services, input unsorted",
			cfg:  v4Config(),
			portals: []Portal{
				{Comment: "kube-system/dns:dns", Protocol: "udp", Port: 53, ClusterIP: a("10.96.0.2"), ProxyPort: 40001},
				{Comment: "default/web:https", Protocol: "tcp", Port: 443, ClusterIP: a("10.96.0.10"), ProxyPort: 38024},
				{Comment: "kube-system/dns:dns-tcp", Protocol: "tcp", Port: 53, ClusterIP: a("10.96.0.2"), ProxyPort: 40002},
				web,
			},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:https" -m tcp --dport 443 -j REDIRECT --to-ports 38024`,
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.2/32 -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 53 -j REDIRECT --to-ports 40001`,
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.2/32 -p tcp -m comment --comment "kube-system/dns:dns-tcp" -m tcp --dport 53 -j REDIRECT --to-ports 40002`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:https" -m tcp --dport 443 -j DNAT --to-destination 10.0.0.5:38024`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.2/32 -p udp -m comment --comment "kube-system/dns:dns" -m udp --dport 53 -j DNAT --to-destination 10.0.0.5:40001`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.2/32 -p tcp -m comment --comment "kube-system/dns:dns-tcp" -m tcp --dport 53 -j DNAT --to-destination 10.0.0.5:40002`,
			},
			filter: []string{
				// One rule per block of 15 port numbers and protocol: 38023 and 38024 share one.
				guardRule("", "tcp", "38023,38024"),
				guardRule("", "tcp", "40002"),
				guardRule("", "udp", "40001"),
			},
		},
		{
			// As kube-proxy's: whatever the address, for containers and the node alike.
			name:    "externalIPs: no physdev or addrtype match",
			cfg:     v4Config(),
			portals: []Portal{with(web, func(p *Portal) { p.ExternalIPs = []netip.Addr{a("192.0.2.9"), a("192.0.2.7")} })},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -d 192.0.2.7/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -d 192.0.2.9/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -d 192.0.2.7/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -d 192.0.2.9/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				webGuard,
			},
		},
		{
			name: "load-balancer IPs: sorted, deduplicated, other family ignored",
			cfg:  v4Config(),
			portals: []Portal{with(web, func(p *Portal) {
				p.LoadBalancerIPs = []netip.Addr{a("203.0.113.2"), a("2001:db8::1"), a("203.0.113.1"), a("203.0.113.2")}
			})},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -d 203.0.113.2/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -d 203.0.113.2/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				webGuard,
			},
		},
		{
			name: "load-balancer source ranges: LB traffic from the ranges redirected, the rest dropped; other family's ranges ignored",
			cfg:  v4Config(),
			portals: []Portal{with(web, func(p *Portal) {
				p.LoadBalancerIPs = []netip.Addr{a("203.0.113.1")}
				p.LoadBalancerSourceRanges = []netip.Prefix{pfx("198.51.100.0/24"), pfx("2001:db8::/32"), pfx("192.0.2.7/16"), {}}
			})},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -s 192.0.0.0/16 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -s 198.51.100.0/24 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -s 192.0.0.0/16 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -s 198.51.100.0/24 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-PORTALS-FILTER -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DROP`,
				webGuard,
			},
		},
		{
			name: "load-balancer source ranges holding the node's address: the LB IPs themselves are sources too (kube-proxy)",
			cfg:  v4Config(),
			portals: []Portal{with(web, func(p *Portal) {
				p.LoadBalancerIPs = []netip.Addr{a("203.0.113.2"), a("203.0.113.1")}
				p.LoadBalancerSourceRanges = []netip.Prefix{pfx("10.0.0.0/24")}
			})},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -s 10.0.0.0/24 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -s 203.0.113.1/32 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -s 10.0.0.0/24 -d 203.0.113.2/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -s 203.0.113.2/32 -d 203.0.113.2/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -s 10.0.0.0/24 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -s 203.0.113.1/32 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -s 10.0.0.0/24 -d 203.0.113.2/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -s 203.0.113.2/32 -d 203.0.113.2/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-PORTALS-FILTER -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DROP`,
				`-A KUBE-PORTALS-FILTER -d 203.0.113.2/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DROP`,
				webGuard,
			},
		},
		{
			name: "load-balancer source ranges without a valid one of the family: no source let in",
			cfg:  v4Config(),
			portals: []Portal{with(web, func(p *Portal) {
				p.ClusterIP = netip.Addr{}
				p.LoadBalancerIPs = []netip.Addr{a("203.0.113.1")}
				p.LoadBalancerSourceRanges = []netip.Prefix{{}, pfx("2001:db8::/32")}
			})},
			filter: []string{
				`-A KUBE-PORTALS-FILTER -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DROP`,
				webGuard,
			},
		},
		{
			name: "load-balancer source ranges with Local policy and no local endpoint: the node and pods in range still redirected",
			cfg: with(v4Config(), func(c *Config) {
				c.ClusterCIDRs = []netip.Prefix{pfx("10.244.0.0/16")}
			}),
			portals: []Portal{with(web, func(p *Portal) {
				p.LoadBalancerIPs = []netip.Addr{a("203.0.113.1")}
				p.LoadBalancerSourceRanges = []netip.Prefix{pfx("10.244.3.0/24"), pfx("10.0.0.0/8"), pfx("198.51.100.0/24")}
				p.External = proxy.Drop
			})},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				// The pod CIDR meets each range: the smaller of the two where they overlap (the LB
				// IP's own range, for the node, holds no pod).
				`-A KUBE-PORTALS-CONTAINER -s 10.244.0.0/16 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -s 10.244.3.0/24 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -s 10.0.0.0/8 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -s 10.244.3.0/24 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -s 198.51.100.0/24 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -s 203.0.113.1/32 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-PORTALS-FILTER -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DROP`,
				webGuard,
			},
		},
		{
			// Found by FuzzRender: IPv6 text in IPv4 rules, which iptables-restore refuses, and
			// with them the whole table.
			name: "IPv4-mapped cluster CIDRs and source ranges are IPv4 prefixes",
			cfg: with(v4Config(), func(c *Config) {
				c.ClusterCIDRs = []netip.Prefix{pfx("::ffff:10.244.0.0/112"), pfx("::ffff:0:0/90")}
			}),
			portals: []Portal{with(web, func(p *Portal) {
				p.ClusterIP = netip.Addr{}
				p.LoadBalancerIPs = []netip.Addr{a("203.0.113.1")}
				p.LoadBalancerSourceRanges = []netip.Prefix{pfx("::ffff:10.244.3.0/120")}
				p.External = proxy.Drop
			})},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -s 10.244.3.0/24 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -s 10.244.3.0/24 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-PORTALS-FILTER -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DROP`,
				webGuard,
			},
		},
		{
			// Found by FuzzRender: "-s 0.0.0.0/0" loads, but iptables-save prints the rule
			// without it.
			name: "a /0 source range or cluster CIDR is no source match",
			cfg: with(v4Config(), func(c *Config) {
				c.ClusterCIDRs = []netip.Prefix{pfx("0.0.0.0/0")}
			}),
			portals: []Portal{
				with(web, func(p *Portal) {
					p.LoadBalancerIPs = []netip.Addr{a("203.0.113.1")}
					p.LoadBalancerSourceRanges = []netip.Prefix{pfx("198.51.100.0/24"), pfx("0.0.0.0/0")}
				}),
				with(web, func(p *Portal) {
					p.Comment = "default/www:http"
					p.ClusterIP = netip.Addr{}
					p.LoadBalancerIPs = []netip.Addr{a("203.0.113.2")}
					p.External = proxy.Drop
				}),
			},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -d 203.0.113.2/32 -p tcp -m comment --comment "default/www:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -d 203.0.113.2/32 -p tcp -m comment --comment "default/www:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-PORTALS-FILTER -d 203.0.113.2/32 -p tcp -m comment --comment "default/www:http" -m tcp --dport 80 -j DROP`,
				webGuard, // www's proxy port is web's: guarded once
			},
		},
		{
			name:    "NodePort on all local addresses",
			cfg:     v4Config(),
			portals: []Portal{with(web, func(p *Portal) { p.NodePort = 30080 })},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-NODEPORT-CONTAINER -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-HOST -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdstport 30080 -j ACCEPT`,
				webGuard,
			},
		},
		{
			name: "NodePort with nodePortAddresses: only node IPs inside the prefixes",
			cfg: with(v4Config(), func(c *Config) {
				c.NodePortAddresses = []netip.Prefix{pfx("10.0.0.0/24"), pfx("fd00::/64"), pfx("172.16.0.0/16")}
			}),
			host:    Host{NodeIPs: []netip.Addr{a("127.0.0.1"), a("10.0.0.7"), a("192.168.1.1"), a("10.0.0.5"), a("fd00::5"), a("172.16.3.4")}},
			portals: []Portal{with(web, func(p *Portal) { p.ClusterIP = netip.Addr{}; p.NodePort = 30080 })},
			nat: []string{
				`-A KUBE-NODEPORT-CONTAINER -d 10.0.0.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-CONTAINER -d 10.0.0.7/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-CONTAINER -d 172.16.3.4/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-HOST -d 10.0.0.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-NODEPORT-HOST -d 10.0.0.7/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-NODEPORT-HOST -d 172.16.3.4/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdst 10.0.0.5 --ctorigdstport 30080 -j ACCEPT`,
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdst 10.0.0.7 --ctorigdstport 30080 -j ACCEPT`,
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdst 172.16.3.4 --ctorigdstport 30080 -j ACCEPT`,
				webGuard,
			},
		},
		{
			name:    "NodePort with localhost NodePorts off: every address but 127.0.0.0/8",
			cfg:     with(v4Config(), func(c *Config) { c.NoLocalhostNodePorts = true }),
			portals: []Portal{with(web, func(p *Portal) { p.ClusterIP = netip.Addr{}; p.NodePort = 30080 })},
			nat: []string{
				`-A KUBE-NODEPORT-CONTAINER ! -d 127.0.0.0/8 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-HOST ! -d 127.0.0.0/8 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdstport 30080 -j ACCEPT`,
				webGuard,
			},
		},
		{
			name: "NodePort with nodePortAddresses holding loopback: served there unless localhost NodePorts are off",
			cfg: with(v4Config(), func(c *Config) {
				c.NodePortAddresses = []netip.Prefix{pfx("127.0.0.0/8"), pfx("10.0.0.0/24"), pfx("::1/128")}
			}),
			host:    Host{NodeIPs: []netip.Addr{a("127.0.0.1"), a("10.0.0.5"), a("::1")}},
			portals: []Portal{with(web, func(p *Portal) { p.ClusterIP = netip.Addr{}; p.NodePort = 30080 })},
			nat: []string{
				`-A KUBE-NODEPORT-CONTAINER -d 10.0.0.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-CONTAINER -d 127.0.0.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-HOST -d 10.0.0.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-NODEPORT-HOST -d 127.0.0.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdst 10.0.0.5 --ctorigdstport 30080 -j ACCEPT`,
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdst 127.0.0.1 --ctorigdstport 30080 -j ACCEPT`,
				webGuard,
			},
		},
		{
			name: "NodePort with nodePortAddresses holding loopback, localhost NodePorts off",
			cfg: with(v4Config(), func(c *Config) {
				c.NodePortAddresses = []netip.Prefix{pfx("127.0.0.0/8"), pfx("10.0.0.0/24")}
				c.NoLocalhostNodePorts = true
			}),
			host:    Host{NodeIPs: []netip.Addr{a("127.0.0.1"), a("10.0.0.5")}},
			portals: []Portal{with(web, func(p *Portal) { p.ClusterIP = netip.Addr{}; p.NodePort = 30080 })},
			nat: []string{
				`-A KUBE-NODEPORT-CONTAINER -d 10.0.0.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-HOST -d 10.0.0.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdst 10.0.0.5 --ctorigdstport 30080 -j ACCEPT`,
				webGuard,
			},
		},
		{
			name:    "IPv6 NodePort with nodePortAddresses holding ::1: never served there",
			cfg:     with(v6Config(), func(c *Config) { c.NodePortAddresses = []netip.Prefix{pfx("::1/128"), pfx("fd00::/64")} }),
			host:    Host{NodeIPs: []netip.Addr{a("::1"), a("fd00::5")}},
			portals: []Portal{{Comment: "default/web:http", Protocol: "tcp", Port: 80, NodePort: 30080, ProxyPort: 38023}},
			nat: []string{
				`-A KUBE-NODEPORT-CONTAINER -d fd00::5/128 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-HOST -d fd00::5/128 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination [fd00::5]:38023`,
			},
			filter: []string{
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdst fd00::5 --ctorigdstport 30080 -j ACCEPT`,
				webGuard,
			},
		},
		{
			name:    "NodePort with nodePortAddresses matching no node IP: no NodePort rules",
			cfg:     with(v4Config(), func(c *Config) { c.NodePortAddresses = []netip.Prefix{pfx("10.9.0.0/16")} }),
			host:    Host{NodeIPs: []netip.Addr{a("10.0.0.5")}},
			portals: []Portal{with(web, func(p *Portal) { p.ClusterIP = netip.Addr{}; p.NodePort = 30080 })},
			filter: []string{
				webGuard,
			},
		},
		{
			name:    "nodePortAddresses of the other family only: all local addresses",
			cfg:     with(v4Config(), func(c *Config) { c.NodePortAddresses = []netip.Prefix{pfx("fd00::/64")} }),
			portals: []Portal{with(web, func(p *Portal) { p.ClusterIP = netip.Addr{}; p.NodePort = 30080 })},
			nat: []string{
				`-A KUBE-NODEPORT-CONTAINER -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-HOST -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdstport 30080 -j ACCEPT`,
				webGuard,
			},
		},
		{
			name:    "bind IP set: DNAT to it from containers and from the host",
			cfg:     with(v4Config(), func(c *Config) { c.BindIP = a("10.0.0.6") }),
			portals: []Portal{with(web, func(p *Portal) { p.NodePort = 30080 })},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.6:38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.6:38023`,
				`-A KUBE-NODEPORT-CONTAINER -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.6:38023`,
				`-A KUBE-NODEPORT-HOST -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.6:38023`,
			},
			filter: []string{
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdstport 30080 -j ACCEPT`,
				// Only the bound address is guarded: the port is free on the others.
				guardRule("-d 10.0.0.6/32 ", "tcp", "38023"),
			},
		},
		{
			name:    "unspecified bind IP behaves like none",
			cfg:     with(v4Config(), func(c *Config) { c.BindIP = a("0.0.0.0") }),
			portals: []Portal{web},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				webGuard,
			},
		},
		{
			name: "reject: no endpoints at all, every address and the NodePort",
			cfg:  v4Config(),
			portals: []Portal{with(web, func(p *Portal) {
				p.Protocol = "udp"
				p.NodePort = 30053
				p.ExternalIPs = []netip.Addr{a("192.0.2.7")}
				p.LoadBalancerIPs = []netip.Addr{a("203.0.113.1")}
				p.Internal, p.External = proxy.Reject, proxy.Reject
				p.ProxyPort = 0
			})},
			filter: []string{
				`-A KUBE-PORTALS-FILTER -d 10.96.0.10/32 -p udp -m comment --comment "default/web:http" -m udp --dport 80 -j REJECT --reject-with icmp-port-unreachable`,
				`-A KUBE-PORTALS-FILTER -d 203.0.113.1/32 -p udp -m comment --comment "default/web:http" -m udp --dport 80 -j REJECT --reject-with icmp-port-unreachable`,
				`-A KUBE-PORTALS-FILTER -d 192.0.2.7/32 -p udp -m comment --comment "default/web:http" -m udp --dport 80 -j REJECT --reject-with icmp-port-unreachable`,
				`-A KUBE-PORTALS-FILTER -p udp -m comment --comment "default/web:http" -m udp --dport 30053 -m addrtype --dst-type LOCAL -j REJECT --reject-with icmp-port-unreachable`,
			},
		},
		{
			name: "drop: external Local policy without local endpoints, internal still redirected",
			cfg:  v4Config(),
			portals: []Portal{with(web, func(p *Portal) {
				p.NodePort = 30080
				p.LoadBalancerIPs = []netip.Addr{a("203.0.113.1")}
				p.External = proxy.Drop
			})},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				// The node's own traffic still reaches the proxy (kube-proxy's src-type LOCAL short-circuit).
				`-A KUBE-PORTALS-HOST -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-NODEPORT-HOST -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-PORTALS-FILTER -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DROP`,
				`-A KUBE-PORTALS-FILTER -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -m addrtype --dst-type LOCAL -j DROP`,
				webGuard,
			},
		},
		{
			name: "drop with cluster CIDRs and localhost NodePorts off: the node's and pods' redirects spare 127.0.0.0/8",
			cfg: with(v4Config(), func(c *Config) {
				c.ClusterCIDRs = []netip.Prefix{pfx("10.244.0.0/16")}
				c.NoLocalhostNodePorts = true
			}),
			portals: []Portal{with(web, func(p *Portal) { p.ClusterIP = netip.Addr{}; p.NodePort = 30080; p.External = proxy.Drop })},
			nat: []string{
				`-A KUBE-NODEPORT-CONTAINER -s 10.244.0.0/16 ! -d 127.0.0.0/8 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-HOST ! -d 127.0.0.0/8 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-NODEPORT-NON-LOCAL -s 10.244.0.0/16 -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdstport 30080 -j ACCEPT`,
				`-A KUBE-PORTALS-FILTER -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -m addrtype --dst-type LOCAL -j DROP`,
				webGuard,
			},
		},
		{
			name: "drop with cluster CIDRs: pods are redirected like the node itself (other family's CIDR ignored)",
			cfg: with(v4Config(), func(c *Config) {
				c.ClusterCIDRs = []netip.Prefix{pfx("10.244.0.0/16"), pfx("fd00:244::/48")}
			}),
			portals: []Portal{with(web, func(p *Portal) {
				p.NodePort = 30080
				p.LoadBalancerIPs = []netip.Addr{a("203.0.113.1")}
				p.ExternalIPs = []netip.Addr{a("192.0.2.7")}
				p.External = proxy.Drop
			})},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -s 10.244.0.0/16 -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -s 10.244.0.0/16 -d 192.0.2.7/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-PORTALS-HOST -d 192.0.2.7/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-NODEPORT-CONTAINER -s 10.244.0.0/16 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-HOST -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				// Pods' NodePort traffic, redirected, passes default-deny firewalls.
				`-A KUBE-NODEPORT-NON-LOCAL -s 10.244.0.0/16 -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdstport 30080 -j ACCEPT`,
				`-A KUBE-PORTALS-FILTER -d 203.0.113.1/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DROP`,
				`-A KUBE-PORTALS-FILTER -d 192.0.2.7/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DROP`,
				`-A KUBE-PORTALS-FILTER -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -m addrtype --dst-type LOCAL -j DROP`,
				webGuard,
			},
		},
		{
			name: "drop NodePort with nodePortAddresses: per address",
			cfg:  with(v4Config(), func(c *Config) { c.NodePortAddresses = []netip.Prefix{pfx("10.0.0.0/24")} }),
			host: Host{NodeIPs: []netip.Addr{a("10.0.0.5"), a("192.168.1.1")}},
			portals: []Portal{with(web, func(p *Portal) {
				p.NodePort = 30080
				p.Internal, p.External = proxy.Redirect, proxy.Drop
			})},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
				`-A KUBE-NODEPORT-HOST -d 10.0.0.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-PORTALS-FILTER -d 10.0.0.5/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DROP`,
				webGuard,
			},
		},
		{
			name: "internal reject, external redirect",
			cfg:  v4Config(),
			portals: []Portal{with(web, func(p *Portal) {
				p.NodePort = 30080
				p.Internal = proxy.Reject
			})},
			nat: []string{
				`-A KUBE-NODEPORT-CONTAINER -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-HOST -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdstport 30080 -j ACCEPT`,
				`-A KUBE-PORTALS-FILTER -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REJECT --reject-with tcp-reset`,
				webGuard,
			},
		},
		{
			name: "IPv6: brackets in DNAT, /128, icmp6 reject, IPv4 addresses ignored",
			cfg:  v6Config(),
			portals: []Portal{
				{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: a("fd00:96::10"), ProxyPort: 38023, NodePort: 30080,
					ExternalIPs: []netip.Addr{a("2001:db8::7"), a("192.0.2.7")}},
				{Comment: "default/dns:dns", Protocol: "udp", Port: 53, ClusterIP: a("fd00:96::2"), Internal: proxy.Reject, External: proxy.Reject},
				{Comment: "default/v4only:x", Protocol: "tcp", Port: 1, ClusterIP: a("10.96.0.1"), ProxyPort: 1000},
			},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d fd00:96::10/128 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-CONTAINER -d 2001:db8::7/128 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d fd00:96::10/128 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination [fd00::5]:38023`,
				`-A KUBE-PORTALS-HOST -d 2001:db8::7/128 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination [fd00::5]:38023`,
				// IPv6's loopback address serves no NodePorts, as in kube-proxy's iptables mode.
				`-A KUBE-NODEPORT-CONTAINER ! -d ::1/128 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j REDIRECT --to-ports 38023`,
				`-A KUBE-NODEPORT-HOST ! -d ::1/128 -p tcp -m comment --comment "default/web:http" -m tcp --dport 30080 -j DNAT --to-destination [fd00::5]:38023`,
			},
			filter: []string{
				`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "default/web:http" -m tcp --dport 38023 -m conntrack --ctstate DNAT --ctorigdstport 30080 -j ACCEPT`,
				`-A KUBE-PORTALS-FILTER -d fd00:96::2/128 -p udp -m comment --comment "default/dns:dns" -m udp --dport 53 -j REJECT --reject-with icmp6-port-unreachable`,
				guardRule("", "tcp", "1000"),
				webGuard,
			},
		},
		{
			name: "IPv6 with bind IP",
			cfg:  with(v6Config(), func(c *Config) { c.BindIP = a("fd00::6") }),
			portals: []Portal{
				{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: a("fd00:96::10"), ProxyPort: 38023},
			},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d fd00:96::10/128 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination [fd00::6]:38023`,
				`-A KUBE-PORTALS-HOST -d fd00:96::10/128 -p tcp -m comment --comment "default/web:http" -m tcp --dport 80 -j DNAT --to-destination [fd00::6]:38023`,
			},
			filter: []string{
				// Only the bound address is guarded: the port is free on the others.
				guardRule("-d fd00::6/128 ", "tcp", "38023"),
			},
		},
		{
			name: "invalid portals are left out",
			cfg:  v4Config(),
			portals: []Portal{
				with(web, func(p *Portal) { p.Protocol = "sctp" }),
				with(web, func(p *Portal) { p.ProxyPort = 0 }),
				with(web, func(p *Portal) { p.Port = 70000 }),
				with(web, func(p *Portal) { p.Comment = "ok/svc:p" }),
			},
			nat: []string{
				`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "ok/svc:p" -m tcp --dport 80 -j REDIRECT --to-ports 38023`,
				`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "ok/svc:p" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:38023`,
			},
			filter: []string{
				guardRule("", "tcp", "38023"),
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			input := slices.Clone(tc.portals)
			nat, filter := Render(tc.cfg, tc.host, tc.portals)
			diff(t, "nat", string(nat), natDecl+lines(tc.nat)+natJumps)
			diff(t, "filter", string(filter), filterDecl+lines(tc.filter)+filterJumps)
			// Deterministic whatever the input order, and the input is not modified.
			if !slices.EqualFunc(input, tc.portals, portalEqual) {
				t.Errorf("Render modified its input")
			}
			rev := slices.Clone(tc.portals)
			slices.Reverse(rev)
			nat2, filter2 := Render(tc.cfg, tc.host, rev)
			if string(nat2) != string(nat) || string(filter2) != string(filter) {
				t.Errorf("output depends on input order")
			}
		})
	}
}

func with[T any](v T, f func(*T)) T {
	f(&v)
	return v
}

func portalEqual(x, y Portal) bool {
	return x.Comment == y.Comment && x.Protocol == y.Protocol && x.Port == y.Port && x.ClusterIP == y.ClusterIP &&
		slices.Equal(x.ExternalIPs, y.ExternalIPs) && slices.Equal(x.LoadBalancerIPs, y.LoadBalancerIPs) &&
		slices.Equal(x.LoadBalancerSourceRanges, y.LoadBalancerSourceRanges) &&
		x.NodePort == y.NodePort && x.ProxyPort == y.ProxyPort && x.Internal == y.Internal && x.External == y.External
}

func lines(ls []string) string {
	if len(ls) == 0 {
		return ""
	}
	return strings.Join(ls, "\n") + "\n"
}

func diff(t *testing.T, what, got, want string) {
	t.Helper()
	if got == want {
		return
	}
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := 0; i < max(len(g), len(w)); i++ {
		var gl, wl string
		if i < len(g) {
			gl = g[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if gl != wl {
			t.Errorf("%s differs at line %d:\n got: %s\nwant: %s\nfull output:\n%s", what, i+1, gl, wl, got)
			return
		}
	}
}

func TestLoopbackNodePortWarnings(t *testing.T) {
	ps := []netip.Prefix{pfx("10.0.0.0/8"), pfx("127.0.0.0/8"), pfx("::1/128")}
	if got := LoopbackNodePortWarnings(ps, false); len(got) != 1 || !strings.Contains(got[0], "::1") {
		t.Errorf("localhost NodePorts on: %q, want one warning, about ::1", got)
	}
	if got := LoopbackNodePortWarnings(ps, true); len(got) != 2 || !strings.Contains(got[0], "127.0.0.0/8") {
		t.Errorf("localhost NodePorts off: %q, want warnings about 127.0.0.0/8 and ::1", got)
	}
	all := []netip.Prefix{pfx("10.0.0.0/8"), pfx("0.0.0.0/0"), pfx("::/0")}
	if got := LoopbackNodePortWarnings(all, true); len(got) != 0 {
		t.Errorf("no loopback selected but by /0: %q, want none", got)
	}
}

func TestNodePortIPs(t *testing.T) {
	addrs := []netip.Addr{a("10.0.0.5"), a("10.0.0.5"), a("127.0.0.1"), a("192.168.1.1"), a("fd00::5"), a("::ffff:10.0.0.9")}
	tests := []struct {
		name     string
		family   iptables.Family
		prefixes []netip.Prefix
		want     []netip.Addr
		wantAll  bool
	}{
		{name: "none: all", family: iptables.IPv4, wantAll: true},
		{name: "zero prefix: all", family: iptables.IPv4, prefixes: []netip.Prefix{pfx("10.0.0.0/8"), pfx("0.0.0.0/0")}, wantAll: true},
		{name: "only other family: all", family: iptables.IPv4, prefixes: []netip.Prefix{pfx("fd00::/8")}, wantAll: true},
		{name: "v4 prefix, mapped and duplicate addresses", family: iptables.IPv4, prefixes: []netip.Prefix{pfx("10.0.0.0/24")}, want: []netip.Addr{a("10.0.0.5"), a("10.0.0.9")}},
		{name: "loopback allowed when asked", family: iptables.IPv4, prefixes: []netip.Prefix{pfx("127.0.0.0/8")}, want: []netip.Addr{a("127.0.0.1")}},
		{name: "unmasked prefix", family: iptables.IPv4, prefixes: []netip.Prefix{pfx("192.168.1.77/24")}, want: []netip.Addr{a("192.168.1.1")}},
		{name: "matches nothing", family: iptables.IPv4, prefixes: []netip.Prefix{pfx("172.16.0.0/12")}},
		{name: "v6", family: iptables.IPv6, prefixes: []netip.Prefix{pfx("10.0.0.0/8"), pfx("fd00::/64")}, want: []netip.Addr{a("fd00::5")}},
		{name: "v6 zero prefix", family: iptables.IPv6, prefixes: []netip.Prefix{pfx("::/0")}, wantAll: true},
		// Found by FuzzRender's generator: an IPv4-mapped prefix was dropped, selecting every address.
		{name: "IPv4-mapped prefix is the IPv4 prefix", family: iptables.IPv4, prefixes: []netip.Prefix{pfx("::ffff:10.0.0.0/120")},
			want: []netip.Addr{a("10.0.0.5"), a("10.0.0.9")}},
		{name: "IPv4-mapped prefix is not IPv6", family: iptables.IPv6, prefixes: []netip.Prefix{pfx("::ffff:10.0.0.0/120")}, wantAll: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, all := NodePortIPs(tc.family, tc.prefixes, addrs)
			if all != tc.wantAll || !slices.Equal(got, tc.want) {
				t.Errorf("NodePortIPs = %v, all=%v; want %v, all=%v", got, all, tc.want, tc.wantAll)
			}
		})
	}
}

func TestPortalValidate(t *testing.T) {
	ok := Portal{Comment: "a/b:c", Protocol: "tcp", Port: 80, ProxyPort: 1000}
	tests := []struct {
		name  string
		p     Portal
		field string // "" = valid
	}{
		{name: "valid", p: ok},
		{name: "reject needs no proxy port", p: with(ok, func(p *Portal) { p.ProxyPort = 0; p.Internal, p.External = proxy.Reject, proxy.Drop })},
		{name: "sctp", p: with(ok, func(p *Portal) { p.Protocol = "sctp" }), field: "protocol"},
		{name: "upper-case protocol", p: with(ok, func(p *Portal) { p.Protocol = "TCP" }), field: "protocol"},
		{name: "port 0", p: with(ok, func(p *Portal) { p.Port = 0 }), field: "port"},
		{name: "nodePort too big", p: with(ok, func(p *Portal) { p.NodePort = 65536 }), field: "nodePort"},
		{name: "redirect needs proxy port", p: with(ok, func(p *Portal) { p.ProxyPort = 0; p.Internal = proxy.Reject }), field: "proxyPort"},
		{name: "unknown action", p: with(ok, func(p *Portal) { p.External = proxy.Action(7) }), field: "external"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.p.Validate()
			if tc.field == "" {
				if err != nil {
					t.Errorf("Validate = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.field+":") || !strings.Contains(err.Error(), `"a/b:c"`) {
				t.Errorf("Validate = %v, want an error naming the portal and field %s", err, tc.field)
			}
		})
	}
}

// guardRule is a rule of KUBE-PORTALS-PROXY-PORTS (IPv4 rejects): ports of proto, to dst ("" or
// "-d ADDR/LEN ").
func guardRule(dst, proto, ports string) string {
	reject := "-j REJECT --reject-with tcp-reset"
	if proto == "udp" {
		reject = "-j REJECT --reject-with icmp-port-unreachable"
	}
	return "-A KUBE-PORTALS-PROXY-PORTS " + dst + "-p " + proto +
		` -m comment --comment "proxy ports of kube-userspace-proxy" -m multiport --dports ` + ports +
		" -m conntrack ! --ctstate DNAT " + reject
}
