//go:build linux

package portal

import (
	"fmt"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/rs/zerolog"
	"net/netip"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables/netnstest"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
)

// scalePortals returns n service ports of a realistic mix: every one has a ClusterIP, every third
// a NodePort, every tenth a load-balancer IP, every twentieth an externalIP, every 25th has no
// endpoints (reject).
func scalePortals(n int) []Portal {
	ps := make([]Portal, n)
	for i := range ps {
		p := Portal{
			Comment:   fmt.Sprintf("ns%d/svc%d:http", i%50, i),
			Protocol:  "tcp",
			Port:      80,
			ClusterIP: netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)}),
			ProxyPort: 32768 + i,
		}
		if i%2 == 1 {
			p.Protocol = "udp"
		}
		if i%3 == 0 {
			p.NodePort = 30000 + i%2768
		}
		if i%10 == 0 {
			p.LoadBalancerIPs = []netip.Addr{netip.AddrFrom4([4]byte{203, 0, byte(i >> 8), byte(i)})}
		}
		if i%20 == 0 {
			p.ExternalIPs = []netip.Addr{netip.AddrFrom4([4]byte{192, 0, byte(i >> 8), byte(i)})}
		}
		if i%25 == 0 {
			p.Internal, p.External = proxy.Reject, proxy.Reject
		}
		ps[i] = p
	}
	return ps
}

func BenchmarkRender(b *testing.B) {
	for _, n := range []int{1000, 5000} {
		ps := scalePortals(n)
		b.Run(fmt.Sprintf("ports=%d", n), func(b *testing.B) {
			var size int
			for b.Loop() {
				nat, filter := Render(v4Config(), Host{}, ps)
				size = len(nat) + len(filter)
			}
			b.ReportMetric(float64(size), "bytes")
		})
	}
}

// BenchmarkSyncInNamespace measures a whole Sync (render, one iptables-restore per table, the
// jump checks) against a real kernel, on both backends: "changed" changes every proxy port on
// each sync, with 1,000 and 5,000 service ports; "periodic-unchanged" is the periodic sync of an
// idle proxy (nothing changed, nobody touched the rules), with 5,000 and 10,000; "one-more" is
// the partial sync (Update) of one service port added to (and, every other op, removed from)
// 10,000, what a new service costs. Besides wall
// time (ns/op) it reports the CPU time of the test process (cpu-self-ms/op: render, checks,
// fork and exec) and of the iptables tools it ran (cpu-tools-ms/op), and the first sync's wall
// time.
func BenchmarkSyncInNamespace(b *testing.B) {
	cases := []struct {
		name    string
		ports   []int
		changed bool
		oneMore bool
	}{
		{"changed", []int{1000, 5000}, true, false},
		{"periodic-unchanged", []int{5000, 10000}, false, false},
		{"one-more", []int{10000}, false, true},
	}
	for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		for _, c := range cases {
			for _, n := range c.ports {
				b.Run(fmt.Sprintf("%s/%s/ports=%d", mode, c.name, n), func(b *testing.B) {
					benchSync(b, mode, scalePortals(n), c.changed, c.oneMore)
				})
			}
		}
	}
}

// benchLogger logs the manager's debug lines (the phases of each sync) to stderr when
// KUP_BENCH_LOG is set.
func benchLogger() zerolog.Logger {
	if os.Getenv("KUP_BENCH_LOG") == "" {
		return zerolog.Nop()
	}
	return zerolog.New(zerolog.ConsoleWriter{Out: os.Stderr}).Level(zerolog.DebugLevel)
}

func benchSync(b *testing.B, mode iptables.Mode, ps []Portal, changed, oneMore bool) {
	ns := netnstest.New(b)
	ns.Do(b, func() {
		r, err := iptables.New(iptables.Options{Family: iptables.IPv4, Mode: mode})
		if err != nil {
			b.Fatal(err)
		}
		m, err := NewManager(Options{Config: v4Config(), Runner: r, Logger: benchLogger()})
		if err != nil {
			b.Fatal(err)
		}
		nodeIPs := localIPs(b)
		start := time.Now()
		if err := m.Sync(ps, nodeIPs); err != nil {
			b.Fatal(err)
		}
		first := time.Since(start)
		self, tools := cpuTimes(b)
		i := 0
		for b.Loop() {
			i++
			if changed {
				for j := range ps {
					ps[j].ProxyPort = 32768 + (j+i)%20000
				}
			}
			if oneMore {
				more := ps
				if i%2 == 1 {
					more = append(ps[:len(ps):len(ps)], Portal{Comment: "ns/more:http", Protocol: "tcp", Port: 80,
						ClusterIP: netip.MustParseAddr("10.97.0.1"), ProxyPort: 60000})
				}
				if err := m.Update(more, nodeIPs); err != nil {
					b.Fatal(err)
				}
				continue
			}
			if err := m.Sync(ps, nodeIPs); err != nil {
				b.Fatal(err)
			}
		}
		self2, tools2 := cpuTimes(b)
		perOp := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 / float64(i) }
		b.ReportMetric(perOp(self2-self), "cpu-self-ms/op")
		b.ReportMetric(perOp(tools2-tools), "cpu-tools-ms/op")
		b.ReportMetric(float64(first.Milliseconds()), "first-sync-ms")
		if err := m.Cleanup(); err != nil {
			b.Fatal(err)
		}
	})
}

// cpuTimes returns the user and system CPU time of this process and of its waited-for children.
func cpuTimes(b *testing.B) (self, children time.Duration) {
	var s, c unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &s); err != nil {
		b.Fatal(err)
	}
	if err := unix.Getrusage(unix.RUSAGE_CHILDREN, &c); err != nil {
		b.Fatal(err)
	}
	tv := func(t unix.Timeval) time.Duration { return time.Duration(t.Nano()) }
	return tv(s.Utime) + tv(s.Stime), tv(c.Utime) + tv(c.Stime)
}

// BenchmarkUpdateDiff is the CPU share of a partial sync (Update) that adds one service port to
// 10,000 and of one that removes it again: render, split into rules, and the difference from
// the rules written before (what iptables-restore is then given), for both tables.
func BenchmarkUpdateDiff(b *testing.B) {
	const n = 10000
	ps := scalePortals(n + 1)
	written := func(ps []Portal) (nat, filter []string) {
		natP, filterP := Render(v4Config(), Host{}, ps)
		return ruleLines(withCanary(natP, natChains())), ruleLines(withCanary(filterP, filterChains()))
	}
	natWas, filterWas := written(ps[:n])
	natMore, filterMore := written(ps)
	var delta, ops int
	self, _ := cpuTimes(b)
	for i := 0; b.Loop(); i++ {
		ops++
		natW, filterW, now := natWas, filterWas, ps
		if i%2 == 1 { // remove it again
			natW, filterW, now = natMore, filterMore, ps[:n]
		}
		natP, filterP := Render(v4Config(), Host{}, now)
		natD := diffRules(natW, ruleLines(withCanary(natP, natChains())))
		filterD, _ := guardedDiff(filterW, ruleLines(withCanary(filterP, filterChains())))
		delta = len(natD) + len(filterD)
	}
	self2, _ := cpuTimes(b)
	b.ReportMetric(float64(delta), "delta-bytes")
	b.ReportMetric(float64(self2-self)/float64(time.Millisecond)/float64(ops), "cpu-ms/op") // less moved by a busy machine than ns/op
}

// BenchmarkUpdateByPortal is BenchmarkUpdateDiff's partial syncs worked out by portal, as Update
// does them now (planByPortal): digest every portal, render the one added, delete the one
// removed.
func BenchmarkUpdateByPortal(b *testing.B) {
	const n = 10000
	ps := scalePortals(n + 1)
	slices.SortFunc(ps[:n], func(a, b Portal) int { return comparePortals(&a, &b) }) // as the proxier's are
	m := &Manager{cfg: v4Config()}
	state := func(ps []Portal) (map[string][]string, *layout) {
		tables, lay := m.renderLocked(Host{}, renderOrder(ps))
		return map[string][]string{tableFilter: ruleLines(tables[0].payload), tableNAT: ruleLines(tables[1].payload)}, lay
	}
	wasW, wasL := state(ps[:n])
	moreW, moreL := state(ps)
	var delta, ops int
	self, _ := cpuTimes(b)
	for i := 0; b.Loop(); i++ {
		ops++
		m.written, m.layout = wasW, wasL
		now := ps
		if i%2 == 1 { // remove it again
			m.written, m.layout, now = moreW, moreL, ps[:n]
		}
		u, ok := m.planByPortal(Host{}, renderOrder(now))
		if !ok {
			b.Fatal("no plan by portal")
		}
		delta = len(u.delta[tableNAT]) + len(u.delta[tableFilter])
	}
	self2, _ := cpuTimes(b)
	b.ReportMetric(float64(delta), "delta-bytes")
	b.ReportMetric(float64(self2-self)/float64(time.Millisecond)/float64(ops), "cpu-ms/op")
}

// BenchmarkToPortals measures what a Set makes of the proxier's 10,000 port states in a
// family: "fresh" without the last sync's portals (a start), "equal" from a new list of the
// same states (a partial sync's: one state changed among them), "same" from the very list of
// the last sync (an idle periodic sync's).
func BenchmarkToPortals(b *testing.B) {
	ports := make([]proxy.PortState, 10000)
	for i, p := range scalePortals(len(ports)) {
		sp := &proxy.ServicePort{Name: proxy.Name{Namespace: fmt.Sprintf("ns%05d", i), Name: "svc", Port: "http"},
			Protocol: v1.ProtocolTCP, Port: p.Port, NodePort: p.NodePort, ClusterIPs: []netip.Addr{p.ClusterIP},
			ExternalIPs: p.ExternalIPs, LoadBalancerIPs: p.LoadBalancerIPs}
		ports[i] = proxy.PortState{ServicePort: sp, ProxyPort: p.ProxyPort, Internal: p.Internal, External: p.External}
	}
	other := slices.Clone(ports)
	b.Run("fresh", func(b *testing.B) {
		for b.Loop() {
			var c portalCache
			c.toPortals(iptables.IPv4, ports)
		}
	})
	b.Run("equal", func(b *testing.B) {
		var c portalCache
		flip := false
		for b.Loop() {
			flip = !flip
			if flip {
				c.toPortals(iptables.IPv4, other)
			} else {
				c.toPortals(iptables.IPv4, ports)
			}
		}
	})
	b.Run("same", func(b *testing.B) {
		var c portalCache
		c.toPortals(iptables.IPv4, ports)
		for b.Loop() {
			c.toPortals(iptables.IPv4, ports)
		}
	})
}
