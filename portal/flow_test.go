//go:build linux

package portal

import (
	"bufio"
	"errors"
	"fmt"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"io"
	"net"
	"net/netip"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables/netnstest"
)

// flowNet is a node namespace and a client namespace joined by a veth pair, with routes that
// make the client send service traffic through the node, and listeners standing in for the proxy.
type flowNet struct {
	node, client         *netnstest.NS
	nodeIP, clientIP     netip.Addr
	tcpPort, udpPort     int // the "proxy" listeners in the node namespace
	clusterIP, lbIP      netip.Addr
	extIP, dropExtIP     netip.Addr // no address of either namespace
	rejectIP, rejectUDP  netip.Addr
	dropIP               netip.Addr
	nodePort, rejectNP   int
	dropNP               int
	family               iptables.Family
	hostPrefix, cliPrefx netip.Prefix
}

func newFlowNet(t *testing.T, f iptables.Family) *flowNet {
	n := &flowNet{node: netnstest.New(t), client: netnstest.New(t), family: f,
		nodePort: 30080, rejectNP: 30081, dropNP: 30082}
	if f == iptables.IPv6 {
		n.nodeIP, n.clientIP = a("fd00:200::1"), a("fd00:200::2")
		n.hostPrefix, n.cliPrefx = pfx("fd00:200::1/64"), pfx("fd00:200::2/64")
		n.clusterIP, n.lbIP, n.extIP = a("fd00:96::10"), a("2001:db8:1::10"), a("2001:db8::50")
		n.rejectIP, n.rejectUDP, n.dropIP = a("fd00:96::20"), a("fd00:96::21"), a("fd00:96::30")
		n.dropExtIP = a("2001:db8::51")
	} else {
		n.nodeIP, n.clientIP = a("10.200.0.1"), a("10.200.0.2")
		n.hostPrefix, n.cliPrefx = pfx("10.200.0.1/24"), pfx("10.200.0.2/24")
		n.clusterIP, n.lbIP, n.extIP = a("10.96.0.10"), a("203.0.113.10"), a("192.0.2.50")
		n.rejectIP, n.rejectUDP, n.dropIP = a("10.96.0.20"), a("10.96.0.21"), a("10.96.0.30")
		n.dropExtIP = a("192.0.2.51")
	}
	netnstest.Connect(t, n.node, "kupn0", []netip.Prefix{n.hostPrefix}, n.client, "kupc0", []netip.Prefix{n.cliPrefx})
	ipFlag := "-4"
	if f == iptables.IPv6 {
		ipFlag = "-6"
		n.node.Sysctl(t, "net.ipv6.conf.all.forwarding", "1")
	} else {
		n.node.Sysctl(t, "net.ipv4.ip_forward", "1")
		// The node's default route points back out of the interface the client's packets came
		// in on, so the node would answer them with ICMP redirects, and the redirect's rate
		// limit (per peer, shared with ICMP errors) would swallow the port unreachable a REJECT
		// sends. Real nodes route service traffic out of another interface.
		n.node.Sysctl(t, "net.ipv4.conf.all.send_redirects", "0")
		n.node.Sysctl(t, "net.ipv4.conf.kupn0.send_redirects", "0")
	}
	// The client reaches service addresses through the node. The node needs a route for them
	// too: its own packets are routed before OUTPUT NAT changes their destination.
	n.client.IP(t, ipFlag, "route", "add", "default", "via", n.nodeIP.String())
	n.node.IP(t, ipFlag, "route", "add", "default", "via", n.clientIP.String())

	n.node.Do(t, func() {
		n.tcpPort = serveTCP(t)
		n.udpPort = serveUDP(t)
	})
	return n
}

// serveTCP listens on all addresses (like the proxy with no bind IP) and greets every connection
// with "proxy <port>\n".
func serveTCP(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatalf("listen tcp: %v", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return // closed by cleanup
			}
			_, _ = io.WriteString(c, "proxy "+strconv.Itoa(port)+"\n")
			_ = c.Close()
		}
	}()
	t.Cleanup(func() { _ = l.Close(); wg.Wait() })
	return port
}

// serveUDP answers every datagram with "proxy <port>".
func serveUDP(t *testing.T) int {
	t.Helper()
	pc, err := net.ListenPacket("udp", ":0")
	if err != nil {
		t.Fatalf("listen udp: %v", err)
	}
	port := pc.LocalAddr().(*net.UDPAddr).Port
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		buf := make([]byte, 1500)
		for {
			_, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo([]byte("proxy "+strconv.Itoa(port)), from)
		}
	}()
	t.Cleanup(func() { _ = pc.Close(); wg.Wait() })
	return port
}

func (n *flowNet) portals() []Portal {
	return []Portal{
		{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: n.clusterIP, NodePort: n.nodePort, ProxyPort: n.tcpPort,
			LoadBalancerIPs: []netip.Addr{n.lbIP}, ExternalIPs: []netip.Addr{n.extIP}},
		{Comment: "default/dns:dns", Protocol: "udp", Port: 53, ClusterIP: n.clusterIP, ProxyPort: n.udpPort},
		{Comment: "default/empty:http", Protocol: "tcp", Port: 80, ClusterIP: n.rejectIP, NodePort: n.rejectNP, Internal: proxy.Reject, External: proxy.Reject},
		{Comment: "default/empty-dns:dns", Protocol: "udp", Port: 53, ClusterIP: n.rejectUDP, Internal: proxy.Reject, External: proxy.Reject},
		{Comment: "default/local:http", Protocol: "tcp", Port: 80, ClusterIP: n.dropIP, NodePort: n.dropNP, ProxyPort: n.tcpPort, External: proxy.Drop,
			ExternalIPs: []netip.Addr{n.dropExtIP}},
	}
}

// dialTCP connects from inside ns and returns the first line the server sends.
func dialTCP(t *testing.T, ns *netnstest.NS, dst netip.Addr, port int, timeout time.Duration) (string, error) {
	t.Helper()
	var (
		c   net.Conn
		err error
	)
	ns.Do(t, func() {
		c, err = net.DialTimeout("tcp", netip.AddrPortFrom(dst, uint16(port)).String(), timeout)
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

// exchangeUDP sends one datagram on a connected UDP socket from inside ns and returns the reply.
func exchangeUDP(t *testing.T, ns *netnstest.NS, dst netip.Addr, port int) (string, error) {
	t.Helper()
	var (
		c   net.Conn
		err error
	)
	ns.Do(t, func() {
		c, err = net.Dial("udp", netip.AddrPortFrom(dst, uint16(port)).String())
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	buf := make([]byte, 100)
	// A reply (or an ICMP error) may race with a lost first datagram; ask a few times.
	for i := 0; i < 5; i++ {
		if _, err = c.Write([]byte("q")); err != nil {
			return "", err
		}
		_ = c.SetReadDeadline(time.Now().Add(time.Second))
		var k int
		k, err = c.Read(buf)
		if err == nil {
			return string(buf[:k]), nil
		}
		if errors.Is(err, syscall.ECONNREFUSED) {
			return "", err
		}
	}
	return "", err
}

// TestPacketFlow sends real traffic through the rules Sync programs, for each backend.
func TestPacketFlow(t *testing.T) {
	requireBackends(t)
	for _, b := range allBackends {
		t.Run(b.String(), func(t *testing.T) {
			n := newFlowNet(t, b.family)
			var m *Manager
			n.node.Do(t, func() {
				m, _ = newTestManager(t, b, Config{Family: b.family, HostIP: n.nodeIP})
				if err := m.Sync(n.portals(), localIPs(t)); err != nil {
					t.Fatalf("Sync: %v", err)
				}
			})
			t.Cleanup(func() { n.node.Do(t, func() { _ = m.Cleanup() }) })

			wantTCP := "proxy " + strconv.Itoa(n.tcpPort)
			wantUDP := "proxy " + strconv.Itoa(n.udpPort)
			reach := []struct {
				name string
				from *netnstest.NS
				dst  netip.Addr
				port int
			}{
				{"ClusterIP from a client (REDIRECT)", n.client, n.clusterIP, 80},
				{"ClusterIP from the node (HOST DNAT)", n.node, n.clusterIP, 80},
				{"load-balancer IP from a client", n.client, n.lbIP, 80},
				{"load-balancer IP from the node", n.node, n.lbIP, 80},
				{"externalIP from a client", n.client, n.extIP, 80},
				{"externalIP from the node", n.node, n.extIP, 80},
				{"externalIP of a Local-policy service from the node (short-circuit)", n.node, n.dropExtIP, 80},
				{"NodePort from a client", n.client, n.nodeIP, n.nodePort},
				{"NodePort from the node", n.node, n.nodeIP, n.nodePort},
				{"ClusterIP of a Local-policy service from a client", n.client, n.dropIP, 80},
			}
			for _, tc := range reach {
				t.Run("tcp "+tc.name, func(t *testing.T) {
					got, err := dialTCP(t, tc.from, tc.dst, tc.port, 5*time.Second)
					if err != nil || got != wantTCP {
						t.Errorf("connect %v:%d = %q, %v; want %q from the proxy listener", tc.dst, tc.port, got, err, wantTCP)
					}
				})
			}
			for _, from := range []struct {
				name string
				ns   *netnstest.NS
			}{{"client", n.client}, {"node", n.node}} {
				t.Run("udp ClusterIP from the "+from.name, func(t *testing.T) {
					got, err := exchangeUDP(t, from.ns, n.clusterIP, 53)
					if err != nil || got != wantUDP {
						t.Errorf("udp %v:53 = %q, %v; want %q", n.clusterIP, got, err, wantUDP)
					}
				})
			}

			refused := []struct {
				name string
				from *netnstest.NS
				dst  netip.Addr
				port int
			}{
				{"reject ClusterIP from a client", n.client, n.rejectIP, 80},
				{"reject ClusterIP from the node", n.node, n.rejectIP, 80},
				{"reject NodePort from a client", n.client, n.nodeIP, n.rejectNP},
				{"reject NodePort from the node", n.node, n.nodeIP, n.rejectNP},
			}
			for _, tc := range refused {
				t.Run("tcp "+tc.name, func(t *testing.T) {
					_, err := dialTCP(t, tc.from, tc.dst, tc.port, 5*time.Second)
					if !errors.Is(err, syscall.ECONNREFUSED) {
						t.Errorf("connect %v:%d error = %v, want ECONNREFUSED", tc.dst, tc.port, err)
					}
				})
			}
			t.Run("udp reject from a client", func(t *testing.T) {
				_, err := exchangeUDP(t, n.client, n.rejectUDP, 53)
				if !errors.Is(err, syscall.ECONNREFUSED) {
					t.Errorf("udp %v:53 error = %v, want ECONNREFUSED", n.rejectUDP, err)
				}
			})
			t.Run("udp reject from the node", func(t *testing.T) {
				// A REJECT in OUTPUT drops the node's own datagram before it leaves, so the
				// kernel fails the send itself with EPERM (kube-proxy's iptables mode does the
				// same); either way the sender learns at once.
				_, err := exchangeUDP(t, n.node, n.rejectUDP, 53)
				if !errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, syscall.EPERM) {
					t.Errorf("udp %v:53 error = %v, want EPERM or ECONNREFUSED", n.rejectUDP, err)
				}
			})

			t.Run("tcp drop NodePort of a Local-policy service from a client", func(t *testing.T) {
				before := dropCount(t, b, n)
				_, err := dialTCP(t, n.client, n.nodeIP, n.dropNP, 300*time.Millisecond)
				var ne net.Error
				if !errors.As(err, &ne) || !ne.Timeout() {
					t.Errorf("connect to dropped NodePort error = %v, want a timeout (no answer at all)", err)
				}
				if after := dropCount(t, b, n); after <= before {
					t.Errorf("DROP rule counter %d -> %d, want it to count the SYN", before, after)
				}
			})
		})
	}
}

// dropCount returns the packet counter of the NodePort DROP rule in the node namespace.
func dropCount(t *testing.T, b backend, n *flowNet) int {
	t.Helper()
	var out []byte
	var err error
	n.node.Do(t, func() {
		out, err = exec.Command(b.cmd("-save"), "-c", "-t", "filter").CombinedOutput()
	})
	if err != nil {
		t.Fatalf("%s-save -c: %v: %s", b, err, out)
	}
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, "--dport "+strconv.Itoa(n.dropNP)) && strings.HasSuffix(l, "-j DROP") && strings.HasPrefix(l, "[") {
			pk, _, _ := strings.Cut(strings.TrimPrefix(l, "["), ":")
			v, err := strconv.Atoi(pk)
			if err != nil {
				t.Fatalf("counter in %q: %v", l, err)
			}
			return v
		}
	}
	t.Fatalf("no DROP rule for NodePort %d in:\n%s", n.dropNP, out)
	return 0
}

// TestLocalhostNodePorts: the node's own connections to a NodePort on the loopback address are
// redirected to the proxy only while localhost NodePorts are on (IPv4; IPv6's ::1 never, as in
// kube-proxy's iptables mode); the node's address serves the NodePort either way. The rules
// written are also those iptables-save lists back.
func TestLocalhostNodePorts(t *testing.T) {
	requireBackends(t)
	for _, b := range allBackends {
		for _, off := range []bool{false, true} {
			t.Run(fmt.Sprintf("%v/localhostNodePorts=%v", b, !off), func(t *testing.T) {
				n := newFlowNet(t, b.family)
				var m *Manager
				n.node.Do(t, func() {
					m, _ = newTestManager(t, b, Config{Family: b.family, HostIP: n.nodeIP, NoLocalhostNodePorts: off})
					if err := m.Sync(n.portals(), localIPs(t)); err != nil {
						t.Fatalf("Sync: %v", err)
					}
					m.mu.Lock()
					ok, why := m.intactBySaveLocked()
					m.mu.Unlock()
					if !ok {
						t.Errorf("rules listed differ from those written: %s", why)
					}
				})
				t.Cleanup(func() { n.node.Do(t, func() { _ = m.Cleanup() }) })

				want := "proxy " + strconv.Itoa(n.tcpPort)
				for _, from := range []*netnstest.NS{n.node, n.client} {
					if got, err := dialTCP(t, from, n.nodeIP, n.nodePort, 5*time.Second); err != nil || got != want {
						t.Errorf("connect %v:%d = %q, %v; want %q", n.nodeIP, n.nodePort, got, err, want)
					}
				}
				loopback := netip.MustParseAddr("127.0.0.1")
				served := !off
				if b.family == iptables.IPv6 {
					loopback, served = netip.IPv6Loopback(), false
				}
				got, err := dialTCP(t, n.node, loopback, n.nodePort, 5*time.Second)
				switch {
				case served && (err != nil || got != want):
					t.Errorf("connect %v:%d from the node = %q, %v; want %q", loopback, n.nodePort, got, err, want)
				case !served && !errors.Is(err, syscall.ECONNREFUSED):
					t.Errorf("connect %v:%d from the node = %q, %v; want ECONNREFUSED (nothing listens there)", loopback, n.nodePort, got, err)
				}
			})
		}
	}
}
