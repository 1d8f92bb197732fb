//go:build linux

package portal

import (
	"bytes"
	"errors"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables/netnstest"
)

// unanswered is how long a connection attempt that a rule drops is given before it counts as
// unanswered. A late answer would make an "unanswered" assertion pass wrongly, never fail.
const unanswered = 300 * time.Millisecond

// refusedTCP asserts that a TCP connection from ns to dst:port is refused (a reset).
func refusedTCP(t *testing.T, ns *netnstest.NS, dst netip.Addr, port int) {
	t.Helper()
	got, err := dialTCP(t, ns, dst, port, 5*time.Second)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("connect %v:%d = %q, %v; want ECONNREFUSED", dst, port, got, err)
	}
}

// refusedUDP asserts that a datagram from ns to dst:port meets an ICMP port unreachable.
func refusedUDP(t *testing.T, ns *netnstest.NS, dst netip.Addr, port int) {
	t.Helper()
	got, err := exchangeUDP(t, ns, dst, port)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("udp %v:%d = %q, %v; want ECONNREFUSED", dst, port, got, err)
	}
}

// droppedTCP asserts that a TCP connection from ns to dst:port gets no answer at all.
func droppedTCP(t *testing.T, ns *netnstest.NS, dst netip.Addr, port int) {
	t.Helper()
	got, err := dialTCP(t, ns, dst, port, unanswered)
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("connect %v:%d = %q, %v; want no answer (a timeout)", dst, port, got, err)
	}
}

// answeredTCP asserts that a TCP connection from ns to dst:port reaches the listener want.
func answeredTCP(t *testing.T, ns *netnstest.NS, dst netip.Addr, port int, want int) {
	t.Helper()
	got, err := dialTCP(t, ns, dst, port, 5*time.Second)
	if w := "proxy " + strconv.Itoa(want); err != nil || got != w {
		t.Errorf("connect %v:%d = %q, %v; want %q", dst, port, got, err, w)
	}
}

// answeredUDP asserts that a datagram from ns to dst:port is answered by the listener want.
func answeredUDP(t *testing.T, ns *netnstest.NS, dst netip.Addr, port int, want int) {
	t.Helper()
	got, err := exchangeUDP(t, ns, dst, port)
	if w := "proxy " + strconv.Itoa(want); err != nil || got != w {
		t.Errorf("udp %v:%d = %q, %v; want %q", dst, port, got, err, w)
	}
}

func loopback(f iptables.Family) netip.Addr {
	if f == iptables.IPv6 {
		return netip.IPv6Loopback()
	}
	return a("127.0.0.1")
}

// TestProxyPortsOnlyRedirected: a proxy port serves only traffic a portal rule sent there. A
// client that connects to the node's address and the proxy port directly is refused (TCP and
// UDP), and so is the node itself on loopback, while the same listeners keep serving
// ClusterIP and NodePort traffic, from clients and from the node.
func TestProxyPortsOnlyRedirected(t *testing.T) {
	requireBackends(t)
	for _, b := range allBackends {
		t.Run(b.String(), func(t *testing.T) {
			n := newFlowNet(t, b.family)
			portals := []Portal{
				{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: n.clusterIP, NodePort: n.nodePort, ProxyPort: n.tcpPort},
				{Comment: "default/dns:dns", Protocol: "udp", Port: 53, ClusterIP: n.clusterIP, NodePort: n.nodePort, ProxyPort: n.udpPort},
			}
			var m *Manager
			n.node.Do(t, func() {
				m, _ = newTestManager(t, b, Config{Family: b.family, HostIP: n.nodeIP})
				t.Cleanup(func() { n.node.Do(t, func() { _ = m.Cleanup() }) })
				if err := m.Sync(portals, localIPs(t)); err != nil {
					t.Fatalf("Sync: %v", err)
				}
			})

			t.Run("direct tcp from a client is refused", func(t *testing.T) { refusedTCP(t, n.client, n.nodeIP, n.tcpPort) })
			t.Run("direct udp from a client is refused", func(t *testing.T) { refusedUDP(t, n.client, n.nodeIP, n.udpPort) })
			t.Run("direct tcp from the node on loopback is refused", func(t *testing.T) {
				refusedTCP(t, n.node, loopback(b.family), n.tcpPort)
			})
			t.Run("direct tcp from the node to its own address is refused", func(t *testing.T) {
				refusedTCP(t, n.node, n.nodeIP, n.tcpPort)
			})
			t.Run("redirected traffic still served", func(t *testing.T) {
				answeredTCP(t, n.client, n.clusterIP, 80, n.tcpPort)
				answeredTCP(t, n.node, n.clusterIP, 80, n.tcpPort)
				answeredTCP(t, n.client, n.nodeIP, n.nodePort, n.tcpPort)
				answeredTCP(t, n.node, n.nodeIP, n.nodePort, n.tcpPort)
				if b.family == iptables.IPv4 { // ::1 serves no NodePorts (TestLocalhostNodePorts)
					answeredTCP(t, n.node, loopback(b.family), n.nodePort, n.tcpPort)
				}
				answeredUDP(t, n.client, n.clusterIP, 53, n.udpPort)
				answeredUDP(t, n.node, n.clusterIP, 53, n.udpPort)
				answeredUDP(t, n.client, n.nodeIP, n.nodePort, n.udpPort)
			})

			// A proxy bound to the node's address leaves the port number free on the others:
			// another program's listener on loopback, on the same port, stays reachable, while
			// the proxy's own listener on the node's address is guarded.
			var port int
			n.node.Do(t, func() {
				other := listenGreeting(t, netip.AddrPortFrom(loopback(b.family), 0), "other")
				port = int(other.Port())
				listenGreeting(t, netip.AddrPortFrom(n.nodeIP, other.Port()), "proxy")
				bound, _ := newTestManager(t, b, Config{Family: b.family, BindIP: n.nodeIP})
				t.Cleanup(func() { n.node.Do(t, func() { _ = bound.Cleanup() }) })
				if err := bound.Sync([]Portal{{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: n.clusterIP, ProxyPort: port}}, localIPs(t)); err != nil {
					t.Fatalf("Sync: %v", err)
				}
			})
			t.Run("bind address: the bound address is guarded", func(t *testing.T) {
				refusedTCP(t, n.client, n.nodeIP, port)
				if got, err := dialTCP(t, n.client, n.clusterIP, 80, 5*time.Second); err != nil || got != "proxy" {
					t.Errorf("connect %v:80 = %q, %v; want the bound listener's %q", n.clusterIP, got, err, "proxy")
				}
			})
			t.Run("bind address: the same port on another address is not", func(t *testing.T) {
				if got, err := dialTCP(t, n.node, loopback(b.family), port, 5*time.Second); err != nil || got != "other" {
					t.Errorf("connect %v:%d = %q, %v; want the other program's %q", loopback(b.family), port, got, err, "other")
				}
			})
		})
	}
}

// TestNodePortNonLocal: behind a default-deny host firewall (INPUT policy DROP, established
// flows and loopback accepted), KUBE-NODEPORT-NON-LOCAL lets in exactly the traffic a NodePort
// rule redirected: not the same proxy port reached directly, not the service's ClusterIP
// traffic, not traffic something else redirected there from another port, and with
// --nodeport-addresses not traffic to a node address outside them.
func TestNodePortNonLocal(t *testing.T) {
	requireBackends(t)
	for _, b := range allBackends {
		t.Run(b.String(), func(t *testing.T) {
			n := newFlowNet(t, b.family)
			// A second node address, on the client's link.
			nodeIP2, bits := a("10.200.0.3"), 24
			if b.family == iptables.IPv6 {
				nodeIP2, bits = a("fd00:200::3"), 64
			}
			args := []string{"addr", "add", netip.PrefixFrom(nodeIP2, bits).String(), "dev", "kupn0"}
			if b.family == iptables.IPv6 {
				args = append(args, "nodad")
			}
			n.node.IP(t, args...)
			portals := []Portal{
				{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: n.clusterIP, NodePort: n.nodePort, ProxyPort: n.tcpPort},
				{Comment: "default/dns:dns", Protocol: "udp", Port: 53, ClusterIP: n.clusterIP, NodePort: n.nodePort, ProxyPort: n.udpPort},
			}
			const otherPort = 8080
			n.node.Do(t, func() {
				b.ipt(t, "-P", "INPUT", "DROP")
				b.ipt(t, "-A", "INPUT", "-i", "lo", "-j", "ACCEPT")
				b.ipt(t, "-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
				if b.family == iptables.IPv6 {
					b.ipt(t, "-A", "INPUT", "-p", "ipv6-icmp", "-j", "ACCEPT") // neighbour discovery
				}
				// Someone else's rules redirect another port, and the first node address's
				// NodePort (outside --nodeport-addresses below), to the proxy port.
				b.ipt(t, "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport", strconv.Itoa(otherPort), "-j", "REDIRECT", "--to-ports", strconv.Itoa(n.tcpPort))
			})
			sync := func(cfg Config) {
				t.Helper()
				n.node.Do(t, func() {
					m, _ := newTestManager(t, b, cfg)
					t.Cleanup(func() { n.node.Do(t, func() { _ = m.Cleanup() }) })
					if err := m.Sync(portals, localIPs(t)); err != nil {
						t.Fatalf("Sync: %v", err)
					}
				})
			}

			sync(Config{Family: b.family, HostIP: n.nodeIP})
			t.Run("NodePort traffic is let in", func(t *testing.T) {
				answeredTCP(t, n.client, n.nodeIP, n.nodePort, n.tcpPort)
				answeredTCP(t, n.client, nodeIP2, n.nodePort, n.tcpPort)
				answeredUDP(t, n.client, n.nodeIP, n.nodePort, n.udpPort)
			})
			t.Run("the proxy port reached directly is not let in", func(t *testing.T) {
				_, err := dialTCP(t, n.client, n.nodeIP, n.tcpPort, unanswered)
				if err == nil {
					t.Errorf("connect %v:%d directly: answered; want refused or dropped", n.nodeIP, n.tcpPort)
				}
			})
			t.Run("ClusterIP traffic to the proxy port is not NodePort traffic", func(t *testing.T) {
				droppedTCP(t, n.client, n.clusterIP, 80)
			})
			t.Run("traffic redirected from another port is not NodePort traffic", func(t *testing.T) {
				droppedTCP(t, n.client, n.nodeIP, otherPort)
			})

			// --nodeport-addresses selects the second address only; someone else redirects the
			// first one's NodePort to the proxy port anyway.
			n.node.Do(t, func() {
				b.ipt(t, "-t", "nat", "-A", "PREROUTING", "-d", n.nodeIP.String(), "-p", "tcp", "--dport", strconv.Itoa(n.nodePort),
					"-j", "REDIRECT", "--to-ports", strconv.Itoa(n.tcpPort))
			})
			sync(Config{Family: b.family, HostIP: n.nodeIP, NodePortAddresses: []netip.Prefix{netip.PrefixFrom(nodeIP2, nodeIP2.BitLen())}})
			t.Run("nodePortAddresses: NodePort traffic to a selected address is let in", func(t *testing.T) {
				answeredTCP(t, n.client, nodeIP2, n.nodePort, n.tcpPort)
			})
			t.Run("nodePortAddresses: NodePort traffic to another node address is not", func(t *testing.T) {
				droppedTCP(t, n.client, n.nodeIP, n.nodePort)
			})
		})
	}
}

// dialTCPFrom is dialTCP from source address src.
func dialTCPFrom(t *testing.T, ns *netnstest.NS, src, dst netip.Addr, port int, timeout time.Duration) (string, error) {
	t.Helper()
	var (
		c   net.Conn
		err error
	)
	ns.Do(t, func() {
		d := net.Dialer{Timeout: timeout, LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0))}
		c, err = d.Dial("tcp", netip.AddrPortFrom(dst, uint16(port)).String())
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 100)
	k, err := c.Read(buf)
	return string(bytes.TrimSpace(buf[:k])), err
}

// exchangeUDPFrom sends datagrams from src to dst:port until one is answered (or refused) and
// returns the answer.
func exchangeUDPFrom(t *testing.T, ns *netnstest.NS, src, dst netip.Addr, port int) (string, error) {
	t.Helper()
	var (
		c   *net.UDPConn
		err error
	)
	ns.Do(t, func() {
		c, err = net.DialUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(src, 0)), net.UDPAddrFromAddrPort(netip.AddrPortFrom(dst, uint16(port))))
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	buf := make([]byte, 100)
	for i := 0; i < 5; i++ {
		if _, err = c.Write([]byte("q")); err != nil {
			return "", err
		}
		_ = c.SetReadDeadline(time.Now().Add(time.Second))
		var k int
		if k, err = c.Read(buf); err == nil {
			return string(buf[:k]), nil
		}
		if errors.Is(err, syscall.ECONNREFUSED) {
			return "", err
		}
	}
	return "", err
}

// filterCounter returns the packet counter of the one rule in our filter chains whose
// iptables-save line contains every one of parts.
func filterCounter(t *testing.T, b backend, ns *netnstest.NS, parts ...string) int {
	t.Helper()
	var out []byte
	var err error
	ns.Do(t, func() { out, err = exec.Command(b.cmd("-save"), "-c", "-t", "filter").CombinedOutput() })
	if err != nil {
		t.Fatalf("%s-save -c: %v: %s", b, err, out)
	}
	found, count := 0, 0
	for _, l := range strings.Split(string(out), "\n") {
		match := strings.HasPrefix(l, "[")
		for _, p := range parts {
			match = match && strings.Contains(l, p)
		}
		if !match {
			continue
		}
		found++
		pk, _, _ := strings.Cut(strings.TrimPrefix(l, "["), ":")
		if count, err = strconv.Atoi(pk); err != nil {
			t.Fatalf("counter in %q: %v", l, err)
		}
	}
	if found != 1 {
		t.Fatalf("%d filter rules contain %q, want 1:\n%s", found, parts, out)
	}
	return count
}

// TestLoadBalancerSourceRanges: with loadBalancerSourceRanges, traffic to a load-balancer IP from
// a source inside a range is served and from any other source dropped (and counted by the
// DROP rule); the ClusterIP stays open to every source. The node's own traffic is a source like
// any other, and when a range holds the node's address, traffic from the load-balancer IP
// itself (a VIP the node holds: its own packets to it come from it) is allowed too, as
// kube-proxy does.
func TestLoadBalancerSourceRanges(t *testing.T) {
	requireBackends(t)
	for _, b := range allBackends {
		t.Run(b.String(), func(t *testing.T) {
			n := newFlowNet(t, b.family)
			client2, bits := a("10.200.0.9"), 24
			otherFamily := pfx("2001:db8:ffff::/48")
			if b.family == iptables.IPv6 {
				client2, bits, otherFamily = a("fd00:200::9"), 64, pfx("192.0.2.0/24")
			}
			args := []string{"addr", "add", netip.PrefixFrom(client2, bits).String(), "dev", "kupc0"}
			if b.family == iptables.IPv6 {
				args = append(args, "nodad")
			}
			n.client.IP(t, args...)
			clientOnly := []netip.Prefix{netip.PrefixFrom(n.clientIP, n.clientIP.BitLen()), otherFamily}
			portals := func(ranges []netip.Prefix) []Portal {
				return []Portal{
					{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: n.clusterIP, ProxyPort: n.tcpPort,
						LoadBalancerIPs: []netip.Addr{n.lbIP}, LoadBalancerSourceRanges: ranges},
					{Comment: "default/dns:dns", Protocol: "udp", Port: 53, ClusterIP: n.clusterIP, ProxyPort: n.udpPort,
						LoadBalancerIPs: []netip.Addr{n.lbIP}, LoadBalancerSourceRanges: ranges},
				}
			}
			var m *Manager
			n.node.Do(t, func() {
				m, _ = newTestManager(t, b, Config{Family: b.family, HostIP: n.nodeIP})
				t.Cleanup(func() { n.node.Do(t, func() { _ = m.Cleanup() }) })
			})
			sync := func(ranges []netip.Prefix) {
				t.Helper()
				n.node.Do(t, func() {
					if err := m.Sync(portals(ranges), localIPs(t)); err != nil {
						t.Fatalf("Sync: %v", err)
					}
				})
			}
			wantTCP, wantUDP := "proxy "+strconv.Itoa(n.tcpPort), "proxy "+strconv.Itoa(n.udpPort)

			sync(clientOnly)
			t.Run("tcp from a source in range", func(t *testing.T) {
				if got, err := dialTCPFrom(t, n.client, n.clientIP, n.lbIP, 80, 5*time.Second); err != nil || got != wantTCP {
					t.Errorf("connect %v:80 from %v = %q, %v; want %q", n.lbIP, n.clientIP, got, err, wantTCP)
				}
			})
			t.Run("udp from a source in range", func(t *testing.T) {
				if got, err := exchangeUDPFrom(t, n.client, n.clientIP, n.lbIP, 53); err != nil || got != wantUDP {
					t.Errorf("udp %v:53 from %v = %q, %v; want %q", n.lbIP, n.clientIP, got, err, wantUDP)
				}
			})
			t.Run("tcp from a source out of range is dropped", func(t *testing.T) {
				lbDrop := []string{"-A " + ChainPortalsFilter + " -d " + netip.PrefixFrom(n.lbIP, n.lbIP.BitLen()).String() + " -p tcp", "-j DROP"}
				before := filterCounter(t, b, n.node, lbDrop...)
				got, err := dialTCPFrom(t, n.client, client2, n.lbIP, 80, unanswered)
				var ne net.Error
				if !errors.As(err, &ne) || !ne.Timeout() {
					t.Errorf("connect %v:80 from %v = %q, %v; want no answer (a timeout)", n.lbIP, client2, got, err)
				}
				if after := filterCounter(t, b, n.node, lbDrop...); after <= before {
					t.Errorf("the load-balancer IP's DROP rule counted %d -> %d packets, want the SYN counted", before, after)
				}
			})
			t.Run("the ClusterIP is open to every source", func(t *testing.T) {
				if got, err := dialTCPFrom(t, n.client, client2, n.clusterIP, 80, 5*time.Second); err != nil || got != wantTCP {
					t.Errorf("connect %v:80 from %v = %q, %v; want %q", n.clusterIP, client2, got, err, wantTCP)
				}
			})
			t.Run("the node, out of range, is not let in", func(t *testing.T) {
				if got, err := dialTCP(t, n.node, n.lbIP, 80, unanswered); err == nil {
					t.Errorf("connect %v:80 from the node = %q; want no answer", n.lbIP, got)
				}
			})

			// The node holds the load-balancer IP (a VIP on lo): its own traffic to it comes from it.
			n.node.IP(t, "addr", "add", netip.PrefixFrom(n.lbIP, n.lbIP.BitLen()).String(), "dev", "lo")
			t.Run("local VIP: the node, out of range, is not let in", func(t *testing.T) {
				if got, err := dialTCP(t, n.node, n.lbIP, 80, unanswered); err == nil {
					t.Errorf("connect %v:80 from the node = %q; want no answer", n.lbIP, got)
				}
			})
			sync(append(slices.Clone(clientOnly), netip.PrefixFrom(n.nodeIP, n.nodeIP.BitLen())))
			t.Run("local VIP: a range holds the node's address: the node is let in", func(t *testing.T) {
				if got, err := dialTCP(t, n.node, n.lbIP, 80, 5*time.Second); err != nil || got != wantTCP {
					t.Errorf("connect %v:80 from the node = %q, %v; want %q", n.lbIP, got, err, wantTCP)
				}
			})
			t.Run("local VIP: a client in range is still served", func(t *testing.T) {
				if got, err := dialTCPFrom(t, n.client, n.clientIP, n.lbIP, 80, 5*time.Second); err != nil || got != wantTCP {
					t.Errorf("connect %v:80 from %v = %q, %v; want %q", n.lbIP, n.clientIP, got, err, wantTCP)
				}
			})
		})
	}
}

// listenGreeting listens on addr (in the calling thread's namespace) until the test ends and
// greets every connection with greeting and a newline; it returns the address it listens on.
func listenGreeting(t *testing.T, addr netip.AddrPort, greeting string) netip.AddrPort {
	t.Helper()
	l, err := net.Listen("tcp", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte(greeting + "\n"))
			c.Close()
		}
	}()
	t.Cleanup(func() { l.Close(); <-done })
	return netip.MustParseAddrPort(l.Addr().String())
}
