//go:build linux

package portal

import (
	"bytes"
	"context"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables/netnstest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// restartPortals are portals of every kind of rule that names a proxy port: redirects of a
// ClusterIP, a NodePort, external IPs, a port of the other protocol; and of rules that do not:
// a port without endpoints (only a guard, which lists proxy ports without names), a port of
// the other family (its guard), one without a listener (none).
func restartPortals() []Portal {
	return []Portal{
		{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: a("10.96.0.10"), ProxyPort: 40001},
		{Comment: "default/web:dns", Protocol: "udp", Port: 53, ClusterIP: a("10.96.0.10"), ProxyPort: 40002},
		{Comment: "default/np:", Protocol: "tcp", Port: 80, ClusterIP: a("10.96.0.11"), NodePort: 30080, ProxyPort: 40003,
			ExternalIPs: []netip.Addr{a("192.0.2.7")}},
		{Comment: "default/empty:", Protocol: "tcp", Port: 80, ClusterIP: a("10.96.0.12"), ProxyPort: 40004,
			Internal: proxy.Reject, External: proxy.Reject},
		{Comment: "default/closed:", Protocol: "tcp", Port: 80, ClusterIP: a("10.96.0.13"),
			Internal: proxy.Reject, External: proxy.Reject},
		{Comment: "v6/svc:p", Protocol: "tcp", Port: 443, ClusterIP: a("fd00:96::10"), ProxyPort: 40005},
	}
}

// The proxy ports read back from rendered rules are the portals' own, whatever the target
// (REDIRECT, DNAT to an IPv4 or a bracketed IPv6 address).
func TestScanProxyPorts(t *testing.T) {
	// A port without endpoints is not named (its listener gets another port after a restart,
	// which no traffic notices: none is redirected to it); each family names its own.
	want := ProxyPorts{
		{"default/web:http", "tcp"}: 40001, {"default/web:dns", "udp"}: 40002,
		{"default/np:", "tcp"}: 40003,
	}
	want6 := ProxyPorts{{"default/np:", "tcp"}: 40003, {"v6/svc:p", "tcp"}: 40005}
	bind4 := v4Config()
	bind4.BindIP = a("10.0.0.6")
	for _, tc := range []struct {
		name string
		cfg  Config
		want ProxyPorts
	}{
		{"IPv4, REDIRECT", v4Config(), want},
		{"IPv4, DNAT to the bind address", bind4, want},
		{"IPv6, DNAT to [address]:port", v6Config(), want6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nat, filter := Render(tc.cfg, Host{NodeIPs: []netip.Addr{a("10.0.0.5"), a("fd00::5")}}, restartPortals())
			if !bytes.Contains(nat, []byte("--to-")) {
				t.Fatalf("no redirect rendered: the case proves nothing:\n%s", nat)
			}
			got := survivors(append(scanProxyPorts(nat), scanProxyPorts(filter)...), zerolog.Nop())
			if !maps.Equal(got, tc.want) {
				t.Errorf("got  %v\nwant %v\nfrom:\n%s%s", got, tc.want, nat, filter)
			}
		})
	}
	pp := ProxyPorts{KeyOf(proxy.Name{Namespace: "default", Name: "web", Port: "dns"}, v1.ProtocolUDP): 40002}
	if got := pp.Port(proxy.Name{Namespace: "default", Name: "web", Port: "dns"}, v1.ProtocolUDP); got != 40002 {
		t.Errorf("Port(default/web:dns, UDP) = %d, want 40002", got)
	}
	if got := pp.Port(proxy.Name{Namespace: "default", Name: "web", Port: "dns"}, v1.ProtocolTCP); got != 0 {
		t.Errorf("Port(default/web:dns, TCP) = %d, want 0", got)
	}
}

// Lines that are not ours, not whole, or hostile name nothing, and never panic.
func TestParseProxyPortRule(t *testing.T) {
	for _, tc := range []struct {
		line string
		want int // 0: nothing
	}{
		{`-A KUBE-PORTALS-CONTAINER -d 10.96.0.10/32 -p tcp -m comment --comment "a/b:c" -m tcp --dport 80 -j REDIRECT --to-ports 40001`, 40001},
		{`-A KUBE-PORTALS-HOST -d 10.96.0.10/32 -p tcp -m comment --comment "a/b:c" -m tcp --dport 80 -j DNAT --to-destination 10.0.0.5:40001`, 40001},
		{`-A KUBE-PORTALS-HOST -p udp -m comment --comment "a/b:c" -j DNAT --to-destination [fd00::5]:40001`, 40001},
		{`-A KUBE-PORTALS-PROXY-PORTS -p tcp -m comment --comment "a/b:c" -m tcp --dport 40001 -m conntrack ! --ctstate DNAT -j REJECT --reject-with tcp-reset`, 40001},
		{`-A KUBE-PORTALS-CONTAINER -p tcp -m comment --comment "a/b:c" --jump REDIRECT --to-ports 40001`, 40001},
		// Not ours, not a proxy port, not readable.
		{`-A PREROUTING -p tcp -m comment --comment "a/b:c" -j REDIRECT --to-ports 40001`, 0},
		{`-A KUBE-PORTALS-FILTER -p tcp -m comment --comment "a/b:c" -m tcp --dport 80 -j REJECT`, 0},
		{`-A KUBE-NODEPORT-NON-LOCAL -p tcp -m comment --comment "a/b:c" -m tcp --dport 40001 -j ACCEPT`, 0},
		{`-A KUBE-PORTALS-PROXY-PORTS -p tcp -m comment --comment "a/b:c" -m tcp ! --dport 40001 -j REJECT`, 0},
		{`-A KUBE-PORTALS-CONTAINER -p tcp -m comment --comment "a/b:c" -j REDIRECT --to-ports 40001-40010`, 0},
		{`-A KUBE-PORTALS-HOST -p tcp -m comment --comment "a/b:c" -j DNAT --to-destination 10.0.0.5-10.0.0.9:40001`, 0},
		{`-A KUBE-PORTALS-HOST -p tcp -m comment --comment "a/b:c" -j DNAT --to-destination 10.0.0.5`, 0},
		{`-A KUBE-PORTALS-CONTAINER -p tcp -m comment --comment "a/b:c" -j REDIRECT --to-ports 0`, 0},
		{`-A KUBE-PORTALS-CONTAINER -p tcp -m comment --comment "a/b:c" -j REDIRECT --to-ports 65536`, 0},
		{`-A KUBE-PORTALS-CONTAINER -p tcp -m comment --comment "a/b:c" -j REDIRECT --to-ports +40001`, 0},
		{`-A KUBE-PORTALS-CONTAINER -p tcp -m comment --comment "a/b:c" -j REDIRECT --to-ports 0040001`, 0},
		{`-A KUBE-PORTALS-CONTAINER -p sctp -m comment --comment "a/b:c" -j REDIRECT --to-ports 40001`, 0},
		{`-A KUBE-PORTALS-CONTAINER -p tcp -j REDIRECT --to-ports 40001`, 0},
		{`-A KUBE-PORTALS-CONTAINER -p tcp -m comment --comment "a/b:c -j REDIRECT --to-ports 40001`, 0},
		{`-A KUBE-PORTALS-CONTAINER -p tcp -m comment --comment`, 0},
		{`-A KUBE-PORTALS-CONTAINER -j REDIRECT --to-ports`, 0},
		{`-A KUBE-PORTALS-CONTAINER`, 0},
		{`-A`, 0},
		{`-A `, 0},
		{`:KUBE-PORTALS-CONTAINER - [0:0]`, 0},
		{`-D KUBE-PORTALS-CONTAINER -p tcp -m comment --comment "a/b:c" -j REDIRECT --to-ports 40001`, 0},
		{"", 0},
		{"\x00\xff\"\\", 0},
	} {
		np, ok := parseProxyPortRule(tc.line)
		if got := np.port; !ok && got != 0 || ok && got != tc.want || !ok && tc.want != 0 {
			t.Errorf("parseProxyPortRule(%q) = %+v, %v; want port %d", tc.line, np, ok, tc.want)
		}
	}
}

// A service port named with several proxy ports, and a proxy port named for several service
// ports, are left out, with a log line each; the others stay.
func TestSurvivorsConflicts(t *testing.T) {
	k := func(name string) PortKey { return PortKey{Name: name, Protocol: "tcp"} }
	var buf bytes.Buffer
	got := survivors([]namedPort{
		{k("ok"), 40001}, {k("ok"), 40001}, // one rule per chain: the same port
		{k("two-ports"), 40002}, {k("two-ports"), 40003},
		{k("shared-a"), 40004}, {k("shared-b"), 40004},
		{PortKey{"ok", "udp"}, 40005},
	}, zerolog.New(&buf))
	want := ProxyPorts{k("ok"): 40001, {"ok", "udp"}: 40005}
	if !maps.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	for _, s := range []string{"two-ports", "shared-a", "shared-b", "several proxy ports", "other service ports too"} {
		if !strings.Contains(buf.String(), s) {
			t.Errorf("log lacks %q:\n%s", s, buf.String())
		}
	}
	if ports := got.Ports(); len(ports) != 2 || ports[0] != 40001 || ports[1] != 40005 {
		t.Errorf("Ports() = %v, want [40001 40005]", ports)
	}
}

// FuzzScanProxyPorts feeds arbitrary listings to the reader of surviving rules: it must not
// panic, and whatever it returns is a service port with a name, TCP or UDP, and a port in
// 1..65535, each proxy port named for one service port only.
//
//	go test -run=^$ -fuzz=^FuzzScanProxyPorts$ -fuzztime=10s ./portal
func FuzzScanProxyPorts(f *testing.F) {
	nat, filter := Render(v4Config(), Host{}, restartPortals())
	f.Add(append(nat, filter...))
	nat, filter = Render(v6Config(), Host{}, restartPortals())
	f.Add(append(nat, filter...))
	f.Add([]byte("-A KUBE-PORTALS-HOST -p tcp -m comment --comment \"a\\\"b\" -j DNAT --to-destination [::1]:1\n"))
	f.Add([]byte("-A KUBE-PORTALS-CONTAINER -p tcp -m comment --comment 'x' -j REDIRECT --to-ports 99999\n-A"))
	f.Fuzz(func(t *testing.T, data []byte) {
		pp := survivors(scanProxyPorts(data), zerolog.Nop())
		owner := map[int]PortKey{}
		for k, p := range pp {
			if k.Name == "" || k.Protocol != "tcp" && k.Protocol != "udp" || p < 1 || p > 65535 {
				t.Fatalf("read %+v -> %d from:\n%q", k, p, data)
			}
			if o, ok := owner[p]; ok {
				t.Fatalf("proxy port %d for both %+v and %+v", p, o, k)
			}
			owner[p] = k
		}
	})
}

// TestPruneStaleInNamespace: at start, of what an earlier run left, only what no Sync rewrites
// goes (jumps of an older form, second copies of jumps, the probe chain); our chains keep their
// rules until the first Sync replaces them.
func TestPruneStaleInNamespace(t *testing.T) { inEachBackend(t, testPruneStale) }

func testPruneStale(t *testing.T, b backend, ad addrs) {
	cfg := Config{Family: b.family, HostIP: ad.host}
	old, _ := newTestManager(t, b, cfg)
	gone := Portal{Comment: "default/gone:", Protocol: "tcp", Port: 80, ClusterIP: ad.clusterIP, NodePort: 30080, ProxyPort: 40001}
	if err := old.Sync([]Portal{gone}, nil); err != nil {
		t.Fatalf("the earlier run's Sync: %v", err)
	}
	// What an older version, a crash in the middle of a probe, and a second copy left.
	b.ipt(t, "-t", "nat", "-I", "PREROUTING", "-j", ChainPortalsContainer)
	b.ipt(t, "-t", "filter", "-A", "FORWARD", "-m", "comment", "--comment", "older", "-j", ChainProxyPorts)
	for _, j := range jumps() {
		if j.table == tableFilter && j.to == ChainProxyPorts {
			b.ipt(t, append([]string{"-t", tableFilter, "-A", j.from}, j.spec...)...)
		}
	}
	b.ipt(t, "-t", "nat", "-N", chainProbe)
	b.ipt(t, "-t", "nat", "-A", "OUTPUT", "-j", chainProbe)
	ourRules := func(table string) []string {
		var out []string
		for _, l := range b.save(t, table) {
			if f := strings.Fields(l); len(f) > 1 && f[0] == "-A" && strings.HasPrefix(f[1], "KUBE-") {
				out = append(out, l)
			}
		}
		return out
	}
	natBefore, filterBefore := ourRules("nat"), ourRules("filter")
	if !slices.ContainsFunc(natBefore, func(l string) bool { return strings.Contains(l, "default/gone") }) {
		t.Fatalf("no rule of the earlier run: the case proves nothing:\n%s", strings.Join(natBefore, "\n"))
	}

	// A restart reads the surviving proxy ports first; PruneStale reuses those listings.
	counting := &countingRunner{Runner: mustRunner(t, b)}
	m, err := NewManager(Options{Config: cfg, Runner: counting})
	if err != nil {
		t.Fatal(err)
	}
	named, err := m.namedProxyPorts(true)
	if err != nil || !slices.ContainsFunc(named, func(np namedPort) bool { return np.port == 40001 }) {
		t.Fatalf("namedProxyPorts = %v, %v; want proxy port 40001 among them", named, err)
	}
	if err := m.PruneStale(); err != nil {
		t.Fatalf("PruneStale: %v", err)
	}
	if counting.saves != 2 {
		t.Errorf("iptables-save ran %d times for the proxy ports and the prune, want 2 (one per table)", counting.saves)
	}
	if got := ourRules("nat"); !slices.Equal(got, natBefore) {
		t.Errorf("nat rules of our chains changed:\n got %q\nwant %q", got, natBefore)
	}
	if got := ourRules("filter"); !slices.Equal(got, filterBefore) {
		t.Errorf("filter rules of our chains changed:\n got %q\nwant %q", got, filterBefore)
	}
	checkOnlyCurrentJumps(t, b)
	checkAbsent(t, b, "nat", chainProbe)

	if err := m.Sync(nil, nil); err != nil {
		t.Fatalf("first Sync: %v", err)
	}
	checkAbsent(t, b, "nat", "default/gone")
	checkAbsent(t, b, "filter", "default/gone")
	checkOnlyCurrentJumps(t, b)
}

// checkOnlyCurrentJumps checks that every jump to our chains is a current one, each once, in
// the order checkJumps wants.
func checkOnlyCurrentJumps(t *testing.T, b backend) {
	t.Helper()
	checkJumps(t, b)
	ours := append(append(natChains(), filterChains()...), chainProbe)
	for _, table := range []string{tableNAT, tableFilter} {
		want := map[string]int{}
		for _, j := range jumps() {
			if j.table == table {
				want["-A "+j.from+" "+strings.Join(j.spec, " ")]++
			}
		}
		got := map[string]int{}
		for _, l := range b.save(t, table) {
			args, err := iptables.SplitRule(l)
			if err != nil || len(args) < 2 || args[0] != "-A" || !slices.Contains(hookChains(table), args[1]) ||
				!slices.Contains(ours, ruleTarget(args)) {
				continue
			}
			got[strings.Join(args, " ")]++
		}
		if !maps.Equal(got, want) {
			t.Errorf("%s jumps to our chains:\n got %v\nwant %v", table, got, want)
		}
	}
}

// TestRestartInNamespace: a Set started over the rules of a killed one (both families, with
// services that are gone since, jumps of an older form, the transparent routing on) finds the
// proxy ports they name, serves from them until its first Sync, and after that Sync leaves
// exactly the rules a fresh start (after --cleanup) leaves.
func TestRestartInNamespace(t *testing.T) {
	requireBackends(t)
	ns := netnstest.New(t)
	ns.IP(t, "addr", "add", "10.200.0.1/32", "dev", "lo")
	ns.IP(t, "addr", "add", "fd00:200::1/128", "dev", "lo")
	ctx := context.Background()
	ns.Do(t, func() {
		web := restartPort("web", "http", v1.ProtocolTCP, 80, 0, "10.96.0.10", "fd00:96::10")
		dns := restartPort("web", "dns", v1.ProtocolUDP, 53, 0, "10.96.0.10")
		gone := restartPort("gone", "", v1.ProtocolTCP, 80, 30080, "10.96.0.11", "fd00:96::11")
		node := proxy.NewNodeAddrs([]netip.Addr{a("10.200.0.1"), a("fd00:200::1")})
		now := []proxy.PortState{{ServicePort: dns, ProxyPort: 40002}, {ServicePort: web, ProxyPort: 40001}}
		before := append([]proxy.PortState{{ServicePort: gone, ProxyPort: 40003}}, now...)

		first := mustNewSet(ctx, t)
		if err := first.Sync(ctx, before, node, true); err != nil {
			t.Fatalf("the earlier run's Sync: %v", err)
		}
		if err := first.EnableTransparent(ctx); err != nil {
			t.Fatalf("EnableTransparent: %v", err)
		}
		backend := detectedBackend(t)
		if len(first.families) != 2 {
			t.Fatalf("the Set manages %d families, want both", len(first.families))
		}
		for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			b := backend
			b.family = fam
			b.ipt(t, "-t", "nat", "-I", "OUTPUT", "-j", ChainPortalsHost) // an older version's jump
		}

		left := map[iptables.Family]string{}
		for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			left[fam] = saveAll(t, fam)
		}
		second := mustNewSet(ctx, t) // the earlier run was killed: nothing cleaned up
		got, err := second.SurvivingProxyPorts(ctx)
		if err != nil {
			t.Fatalf("SurvivingProxyPorts: %v", err)
		}
		want := ProxyPorts{KeyOf(web.Name, web.Protocol): 40001, KeyOf(dns.Name, dns.Protocol): 40002, KeyOf(gone.Name, gone.Protocol): 40003}
		if !maps.Equal(got, want) {
			t.Errorf("SurvivingProxyPorts = %v, want %v", got, want)
		}
		for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			// Nothing changes before the first Sync: the listeners open on the surviving
			// proxy ports first.
			if now := saveAll(t, fam); now != left[fam] {
				t.Errorf("%v: NewSet and SurvivingProxyPorts changed the rules:\nbefore:\n%s\nafter:\n%s", fam, left[fam], now)
			}
		}
		if err := second.Sync(ctx, now, node, true); err != nil {
			t.Fatalf("first Sync after the restart: %v", err)
		}
		restarted := map[iptables.Family]string{}
		for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			restarted[fam] = saveAll(t, fam)
			if strings.Contains(restarted[fam], "default/gone") || strings.Contains(restarted[fam], "KUBE-PORTALS-TRANSPARENT") {
				t.Errorf("%v: stale rules outlived the first sync:\n%s", fam, restarted[fam])
			}
		}

		// The first Sync wrote only the difference (the gone service's rules deleted, its guard
		// changed); the next full one finds the rules intact and writes nothing (the periodic
		// rewrite puts them in Render's order).
		if err := second.Sync(ctx, now, node, true); err != nil {
			t.Fatalf("second Sync after the restart: %v", err)
		}
		for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			if got := saveAll(t, fam); got != restarted[fam] {
				t.Errorf("%v: the second sync of a restart changed the rules:\nafter the first:\n%s\nafter the second:\n%s", fam, restarted[fam], got)
			}
		}

		if err := CleanupAll(ctx, zerolog.Nop()); err != nil {
			t.Fatalf("CleanupAll: %v", err)
		}
		fresh := mustNewSet(ctx, t)
		if err := fresh.Sync(ctx, now, node, true); err != nil {
			t.Fatalf("fresh Sync: %v", err)
		}
		sorted := func(listing string) []string { return slices.Sorted(strings.Lines(listing)) }
		for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			f := saveAll(t, fam)
			if !slices.Equal(sorted(f), sorted(restarted[fam])) {
				t.Errorf("%v: after the first sync of a restart (any order):\n%s\nafter a fresh start:\n%s", fam, restarted[fam], f)
			}
		}
	})
}

// restartPort returns a service port of namespace default.
func restartPort(name, port string, proto v1.Protocol, number, nodePort int, clusterIPs ...string) *proxy.ServicePort {
	sp := &proxy.ServicePort{Name: proxy.Name{Namespace: "default", Name: name, Port: port}, Protocol: proto, Port: number, NodePort: nodePort}
	for _, ip := range clusterIPs {
		sp.ClusterIPs = append(sp.ClusterIPs, a(ip))
	}
	return sp
}

func mustNewSet(ctx context.Context, t *testing.T) *Set {
	t.Helper()
	s, err := NewSet(ctx, SetOptions{Log: zerolog.New(zerolog.NewTestWriter(t))})
	if err != nil {
		t.Fatalf("NewSet: %v", err)
	}
	return s
}

// detectedBackend returns the IPv4 backend NewSet picks in the calling thread's namespace.
func detectedBackend(t *testing.T) backend {
	t.Helper()
	mode, _, err := iptables.DetectMode()
	if err != nil {
		t.Fatalf("DetectMode: %v", err)
	}
	return backend{family: iptables.IPv4, mode: mode}
}

// saveAll returns the nat, filter and mangle tables of a family, as the detected backend saves
// them, without comments and counters.
func saveAll(t *testing.T, fam iptables.Family) string {
	t.Helper()
	b := detectedBackend(t)
	b.family = fam
	var out []string
	for _, table := range []string{"nat", "filter", "mangle"} {
		for _, l := range b.save(t, table) {
			if i := strings.LastIndex(l, " ["); strings.HasPrefix(l, ":") && i > 0 {
				l = l[:i]
			}
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// staleJumps deletes jumps of an older form, and, in a built-in chain holding a second copy of
// a current jump, every jump to our chains; it leaves rules of others alone and refuses a
// listing it cannot read.
func TestStaleJumps(t *testing.T) {
	cur := func(from, to string) string {
		for _, j := range jumps() {
			if j.from == from && j.to == to {
				quoted := make([]string, len(j.spec))
				for i, a := range j.spec {
					quoted[i] = iptables.Quote(a)
				}
				return "-A " + from + " " + strings.Join(quoted, " ")
			}
		}
		t.Fatalf("no jump %s -> %s", from, to)
		return ""
	}
	save := strings.Join([]string{
		"*filter", ":INPUT ACCEPT [0:0]", ":KUBE-PORTALS-PROXY-PORTS - [0:0]",
		cur("INPUT", ChainProxyPorts), cur("INPUT", ChainPortalsFilter), cur("INPUT", ChainProxyPorts),
		cur("OUTPUT", ChainPortalsFilter),
		"-A OUTPUT -j KUBE-PORTALS-FILTER",
		"-A FORWARD -j DOCKER-USER",
		`-A KUBE-PORTALS-PROXY-PORTS -p tcp -m comment --comment "a/b:" -j REJECT`,
		"COMMIT", "",
	}, "\n")
	payload, n, rebuild, err := staleJumps(tableFilter, []byte(save))
	if err != nil {
		t.Fatal(err)
	}
	del := func(rule string) string { return "-D " + strings.TrimPrefix(rule, "-A ") }
	want := []string{del(cur("INPUT", ChainProxyPorts)), del(cur("INPUT", ChainPortalsFilter)), del(cur("INPUT", ChainProxyPorts)),
		"-D OUTPUT -j KUBE-PORTALS-FILTER"}
	var got []string
	for _, l := range strings.Split(strings.TrimSpace(string(payload)), "\n") {
		args, err := iptables.SplitRule(l)
		if err != nil {
			t.Fatalf("payload line %q: %v", l, err)
		}
		got = append(got, strings.Join(args, " "))
	}
	for i := range want {
		args, _ := iptables.SplitRule(want[i])
		want[i] = strings.Join(args, " ")
	}
	if !slices.Equal(got, want) || n != 4 || !maps.Equal(rebuild, map[string]bool{"INPUT": true}) {
		t.Errorf("staleJumps = %d, %v:\n%s\nwant 4, [INPUT]:\n%s", n, rebuild, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if _, _, _, err := staleJumps(tableFilter, []byte("-A INPUT -m comment --comment \"open -j KUBE-PORTALS-FILTER\n")); err == nil {
		t.Error("an unreadable rule: no error")
	}
}

// TestSuccessorKeepsNoStartListings: a restart's Set keeps what SurvivingProxyPorts read for
// its first prune; a successor's, which never prunes (and whose predecessor goes on writing
// rules), keeps nothing.
func TestSuccessorKeepsNoStartListings(t *testing.T) {
	for _, successor := range []bool{false, true} {
		m, err := NewManager(Options{Config: v4Config(), Runner: &fakeRunner{}})
		if err != nil {
			t.Fatal(err)
		}
		set := &Set{families: []familyPortals{{family: iptables.IPv4, manager: m}}, prepared: successor}
		if _, err := set.SurvivingProxyPorts(context.Background()); err != nil {
			t.Fatal(err)
		}
		if kept := m.startSaves != nil; kept == successor {
			t.Errorf("successor %v: the start's listings kept: %v", successor, kept)
		}
	}
}
