//go:build linux

package portal

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables/netnstest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal/conntrack"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// recordingFlows records DeleteUDP calls; the first fail calls fail.
type recordingFlows struct {
	calls [][]string
	fail  int
}

func (r *recordingFlows) DeleteUDP(dsts []netip.AddrPort) error {
	var call []string
	for _, d := range dsts {
		call = append(call, d.String())
	}
	r.calls = append(r.calls, call)
	if r.fail > 0 {
		r.fail--
		return errors.New("conntrack: injected failure")
	}
	return nil
}

// Stale UDP flows are deleted for every UDP target on the first sync, then only for targets
// whose handling changed or that went away, in one call per sync; TCP portals and failed syncs
// delete nothing. A NodePort's targets are the node's addresses of the family: with
// --nodeport-addresses, only those it selects.
func TestStaleUDPFlows(t *testing.T) {
	nodeIPs := []netip.Addr{a("10.0.0.5"), a("127.0.0.1"), a("fd00::5"), a("192.168.1.5")}
	for _, tc := range []struct {
		name      string
		cfg       Config
		nodePorts []string
	}{
		{name: "NodePorts on every address", cfg: v4Config(), nodePorts: []string{"10.0.0.5:30053", "127.0.0.1:30053", "192.168.1.5:30053"}},
		{name: "localhost NodePorts off", cfg: with(v4Config(), func(c *Config) { c.NoLocalhostNodePorts = true }),
			nodePorts: []string{"10.0.0.5:30053", "192.168.1.5:30053"}},
		{name: "nodePortAddresses", cfg: with(v4Config(), func(c *Config) { c.NodePortAddresses = []netip.Prefix{pfx("10.0.0.0/8")} }),
			nodePorts: []string{"10.0.0.5:30053"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			flows := &recordingFlows{}
			f := &fakeRunner{}
			m, err := NewManager(Options{Config: tc.cfg, Runner: f, Flows: flows})
			if err != nil {
				t.Fatal(err)
			}
			dns := Portal{Comment: "kube-system/dns:dns", Protocol: "udp", Port: 53, ClusterIP: a("10.96.0.10"), ProxyPort: 40000,
				NodePort: 30053, ExternalIPs: []netip.Addr{a("192.0.2.7"), a("2001:db8::7")}}
			web := Portal{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: a("10.96.0.20"), ProxyPort: 40001}
			step := func(name string, sync func([]Portal, []netip.Addr) error, ps []Portal, want ...string) {
				t.Helper()
				flows.calls = nil
				if err := sync(ps, nodeIPs); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				for _, c := range flows.calls {
					slices.Sort(c)
				}
				var wantCalls [][]string
				if len(want) > 0 {
					slices.Sort(want)
					wantCalls = [][]string{want}
				}
				if !slices.EqualFunc(flows.calls, wantCalls, slices.Equal) {
					t.Errorf("%s: deleted flows of %q, want %q (one call)", name, flows.calls, wantCalls)
				}
			}
			all := append([]string{"10.96.0.10:53", "192.0.2.7:53"}, tc.nodePorts...)
			step("first sync", m.Sync, []Portal{dns, web}, all...)
			step("no change", m.Update, []Portal{dns, web})
			moved := dns
			moved.ProxyPort = 40002 // a new listener (say, after a protocol change)
			step("new proxy port", m.Update, []Portal{moved, web}, all...)
			lbDNS := moved
			lbDNS.LoadBalancerIPs = []netip.Addr{a("203.0.113.53")}
			step("a load-balancer IP", m.Update, []Portal{lbDNS, web}, "203.0.113.53:53")
			lbDNS.LoadBalancerSourceRanges = []netip.Prefix{pfx("198.51.100.0/24")}
			step("source ranges on it", m.Update, []Portal{lbDNS, web}, "203.0.113.53:53")
			rejected := moved
			rejected.Internal = proxy.Reject
			step("ClusterIP now rejected, load-balancer IP gone", m.Sync, []Portal{rejected, web}, "10.96.0.10:53", "203.0.113.53:53")
			step("service gone", m.Update, []Portal{web}, all...)
			f.failRestore = map[string]bool{tableNAT: true}
			flows.calls = nil
			if err := m.Sync([]Portal{dns}, nodeIPs); err == nil {
				t.Fatal("Sync with a failing restore: no error")
			}
			if len(flows.calls) != 0 {
				t.Errorf("a failed sync deleted flows: %v", flows.calls)
			}
		})
	}
}

// conntrackTool returns the conntrack tool, wrapped by a script that counts its runs in a file.
func conntrackTool(t *testing.T) (tool *conntrack.Tool, runs func() int) {
	t.Helper()
	netnstest.RequireTools(t, "Debian package conntrack", "conntrack")
	real, _ := exec.LookPath("conntrack")
	dir := t.TempDir()
	count := filepath.Join(dir, "runs")
	script := filepath.Join(dir, "conntrack")
	if err := os.WriteFile(script, []byte("#!/bin/sh\necho run >> "+count+"\nexec "+real+" \"$@\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return &conntrack.Tool{Path: script}, func() int {
		b, _ := os.ReadFile(count)
		return strings.Count(string(b), "\n")
	}
}

// udpFlowTo reports whether `conntrack -L` in the calling thread's namespace lists a UDP flow
// whose original destination is dst.
func udpFlowTo(t *testing.T, dst netip.AddrPort) bool {
	t.Helper()
	family := "ipv4"
	if dst.Addr().Is6() {
		family = "ipv6"
	}
	out, err := exec.Command("conntrack", "-L", "-p", "udp", "-f", family).CombinedOutput()
	if err != nil {
		t.Fatalf("conntrack -L: %v: %s", err, out)
	}
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, " dst="+dst.Addr().String()+" ") && strings.Contains(l, " dport="+strconv.Itoa(int(dst.Port()))+" ") {
			// the first dst= and dport= of a line are the original direction's
			i, j := strings.Index(l, " dst="), strings.Index(l, " dport=")
			if strings.HasPrefix(l[i:], " dst="+dst.Addr().String()+" ") && strings.HasPrefix(l[j:], " dport="+strconv.Itoa(int(dst.Port()))+" ") {
				return true
			}
		}
	}
	return false
}

// The first sync deletes the tracked UDP flows of the NodePort on the node's addresses, and
// nothing else: a flow of another service (here another proxy's, DNATed by its own rule) to the
// same port number survives. All deletions of a sync take one run of the tool; a sync with
// nothing stale takes none.
func TestStaleFlowsExact(t *testing.T) {
	requireBackends(t)
	for _, b := range []backend{{iptables.IPv4, iptables.ModeNFT}, {iptables.IPv6, iptables.ModeNFT}} {
		t.Run(b.String(), func(t *testing.T) {
			ns := netnstest.New(t)
			node, other, clusterIP, local := a("10.200.0.1"), a("10.96.0.20"), a("10.96.0.10"), "127.0.0.1:5353"
			if b.family == iptables.IPv6 {
				node, other, clusterIP, local = a("fd00:200::1"), a("fd00:96::20"), a("fd00:96::10"), "[::1]:5353"
			}
			args := []string{"addr", "add", netip.PrefixFrom(node, node.BitLen()).String(), "dev", "lo"}
			if node.Is6() {
				args = append(args, "nodad")
			}
			ns.IP(t, args...)
			if node.Is6() {
				ns.IP(t, "-6", "route", "add", "default", "dev", "lo")
			} else {
				ns.IP(t, "route", "add", "default", "dev", "lo")
			}
			tool, runs := conntrackTool(t)
			nodePortFlow := netip.AddrPortFrom(node, 30053)
			otherFlow := netip.AddrPortFrom(other, 30053)
			ns.Do(t, func() {
				b.ipt(t, "-t", "nat", "-A", "OUTPUT", "-d", other.String(), "-p", "udp", "--dport", "30053", "-j", "DNAT", "--to-destination", local)
				for _, dst := range []netip.AddrPort{nodePortFlow, otherFlow} {
					c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(dst))
					if err != nil {
						t.Fatal(err)
					}
					_, err = c.Write([]byte("q"))
					c.Close()
					if err != nil {
						t.Fatal(err)
					}
					if !udpFlowTo(t, dst) {
						t.Fatalf("no tracked flow to %v", dst)
					}
				}

				m, err := NewManager(Options{Config: Config{Family: b.family, HostIP: node}, Runner: mustRunner(t, b), Flows: tool})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { ns.Do(t, func() { _ = m.Cleanup() }) })
				portals := []Portal{
					{Comment: "kube-system/dns:dns", Protocol: "udp", Port: 53, ClusterIP: clusterIP, NodePort: 30053, ProxyPort: 40053},
					{Comment: "default/syslog:syslog", Protocol: "udp", Port: 514, ClusterIP: other.Next(), ProxyPort: 40514},
				}
				if err := m.Sync(portals, localIPs(t)); err != nil {
					t.Fatalf("Sync: %v", err)
				}
				if udpFlowTo(t, nodePortFlow) {
					t.Errorf("the NodePort's stale flow to %v survived the first sync", nodePortFlow)
				}
				if !udpFlowTo(t, otherFlow) {
					t.Errorf("another service's flow to %v was deleted", otherFlow)
				}
				if n := runs(); n != 1 {
					t.Errorf("the first sync ran conntrack %d times, want 1", n)
				}
				if err := m.Sync(portals, localIPs(t)); err != nil {
					t.Fatalf("second Sync: %v", err)
				}
				if n := runs(); n != 1 {
					t.Errorf("a sync with nothing stale ran conntrack: %d runs in all, want 1", n)
				}
			})
		})
	}
}

// A conntrack that hangs is killed after the tool's timeout: the sync still completes, and
// succeeds (stale flows are logged, not an error of the sync).
func TestStaleFlowsHungTool(t *testing.T) {
	script := filepath.Join(t.TempDir(), "conntrack")
	if err := os.WriteFile(script, []byte("#!/bin/sh\nsleep 3600\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	var log strings.Builder
	m, err := NewManager(Options{Config: v4Config(), Runner: &fakeRunner{}, Logger: zerolog.New(&log),
		Flows: &conntrack.Tool{Path: script, Timeout: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	dns := Portal{Comment: "kube-system/dns:dns", Protocol: "udp", Port: 53, ClusterIP: a("10.96.0.10"), ProxyPort: 40000}
	if err := m.Sync([]Portal{dns}, nil); err != nil {
		t.Errorf("Sync with a hung conntrack = %v, want nil", err)
	}
	if !strings.Contains(log.String(), "cannot delete stale UDP flows") || !strings.Contains(log.String(), "timed out") {
		t.Errorf("log lacks the timed-out deletion:\n%s", log.String())
	}
}

// A successor seeded with its predecessor's flow targets (a hand-over) deletes, at its first
// sync, only the flows of targets whose handling changed since the predecessor's last sync: the
// UDP sessions it adopted keep their flows, so their clients keep their source ports and their
// endpoints. Unseeded, its first sync deletes them all.
func TestFlowTargetsHandedOver(t *testing.T) {
	nodeIPs := []netip.Addr{a("10.0.0.5")}
	dns := Portal{Comment: "kube-system/dns:dns", Protocol: "udp", Port: 53, ClusterIP: a("10.96.0.10"), ProxyPort: 40000}
	stats := Portal{Comment: "default/stats:udp", Protocol: "udp", Port: 8125, ClusterIP: a("10.96.0.30"), ProxyPort: 40003}
	newSet := func() (*Set, *recordingFlows) {
		t.Helper()
		flows := &recordingFlows{}
		m, err := NewManager(Options{Config: v4Config(), Runner: &fakeRunner{}, Flows: flows})
		if err != nil {
			t.Fatal(err)
		}
		return &Set{families: []familyPortals{{family: iptables.IPv4, manager: m}}, prepared: true}, flows
	}
	old, _ := newSet()
	if err := old.families[0].manager.Sync([]Portal{dns, stats}, nodeIPs); err != nil {
		t.Fatal(err)
	}
	ft := old.FlowTargets()
	if len(ft["IPv4"]) != 2 {
		t.Fatalf("FlowTargets = %v, want the two UDP targets", ft)
	}

	successor, flows := newSet()
	successor.SeedFlowTargets(ft)
	moved := stats
	moved.ProxyPort = 40004 // changed while the hand-over ran
	if err := successor.families[0].manager.Sync([]Portal{dns, moved}, nodeIPs); err != nil {
		t.Fatal(err)
	}
	if want := [][]string{{"10.96.0.30:8125"}}; !slices.EqualFunc(flows.calls, want, slices.Equal) {
		t.Errorf("the seeded successor's first sync deleted the flows of %q, want only %q", flows.calls, want)
	}

	fresh, freshFlows := newSet()
	if err := fresh.families[0].manager.Sync([]Portal{dns, moved}, nodeIPs); err != nil {
		t.Fatal(err)
	}
	if len(freshFlows.calls) != 1 || len(freshFlows.calls[0]) != 2 {
		t.Errorf("an unseeded first sync deleted the flows of %q, want both targets", freshFlows.calls)
	}
}

// A failed deletion of stale flows is tried again — a client that keeps sending keeps its stale
// flow alive for ever — at a later sync once its backoff has passed, even a sync that writes
// nothing, with the targets that went away meanwhile; RetryDue tells the proxier when, and says
// nothing once a deletion succeeded. A successor handed over while a retry waits deletes the
// waiting targets' flows at its first sync.
func TestStaleFlowsRetried(t *testing.T) {
	nodeIPs := []netip.Addr{a("10.0.0.5")}
	dns := Portal{Comment: "kube-system/dns:dns", Protocol: "udp", Port: 53, ClusterIP: a("10.96.0.10"), ProxyPort: 40000}
	stats := Portal{Comment: "default/stats:udp", Protocol: "udp", Port: 8125, ClusterIP: a("10.96.0.30"), ProxyPort: 40003}
	flows := &recordingFlows{fail: 2}
	m, err := NewManager(Options{Config: v4Config(), Runner: &fakeRunner{}, Flows: flows})
	if err != nil {
		t.Fatal(err)
	}
	set := &Set{families: []familyPortals{{family: iptables.IPv4, manager: m}}, prepared: true}
	sync := func(name string, fn func([]Portal, []netip.Addr) error, ps []Portal, want ...string) {
		t.Helper()
		flows.calls = nil
		if err := fn(ps, nodeIPs); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		var wantCalls [][]string
		if len(want) > 0 {
			wantCalls = [][]string{want}
		}
		if !slices.EqualFunc(flows.calls, wantCalls, slices.Equal) {
			t.Errorf("%s: deleted flows of %q, want %q", name, flows.calls, wantCalls)
		}
	}
	due := func(name string, want bool) {
		t.Helper()
		at, ok := set.RetryDue()
		if ok != want {
			t.Fatalf("%s: RetryDue = %v, %v; want a retry waiting: %v", name, at, ok, want)
		}
	}
	sync("first sync, deletion fails", m.Sync, []Portal{dns, stats}, "10.96.0.10:53", "10.96.0.30:8125")
	due("after the failure", true)
	sync("before the backoff passed", m.Update, []Portal{dns, stats})
	ft := set.FlowTargets()
	m.mu.Lock()
	m.flowRetryAt = time.Now().Add(-time.Millisecond)
	m.mu.Unlock()
	sync("retry with nothing to write, fails again", m.Update, []Portal{dns, stats}, "10.96.0.10:53", "10.96.0.30:8125")
	due("after the second failure", true)
	if at, _ := set.RetryDue(); time.Until(at) < 1500*time.Millisecond {
		t.Errorf("the second retry is due in %v, want the backoff doubled to 2 s", time.Until(at).Round(time.Millisecond))
	}
	sync("stats went away: a deletion anyway, with the waiting targets", m.Update, []Portal{dns}, "10.96.0.10:53", "10.96.0.30:8125")
	due("after a successful deletion", false)
	sync("nothing stale", m.Update, []Portal{dns})

	// A successor seeded while the first failure's retry waited deletes both targets' flows.
	succ, err := NewManager(Options{Config: v4Config(), Runner: &fakeRunner{}, Flows: flows})
	if err != nil {
		t.Fatal(err)
	}
	(&Set{families: []familyPortals{{family: iptables.IPv4, manager: succ}}, prepared: true}).SeedFlowTargets(ft)
	sync("successor's first sync", succ.Sync, []Portal{dns, stats}, "10.96.0.10:53", "10.96.0.30:8125")
}
