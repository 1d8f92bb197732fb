//go:build linux

package forward

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// netnsEnv carries the name of the network namespace TestOriginalDestination made to the copy
// of itself it runs inside it.
const netnsEnv = "KUP_FORWARD_NETNS"

// TestOriginalDestination checks SO_ORIGINAL_DST and IP(V6)_RECVORIGDSTADDR against real NAT:
// it makes a network namespace, runs itself inside it, and there sends TCP connections and UDP
// datagrams to a "service" address that iptables DNATs or REDIRECTs to the proxy. The Chooser
// must see the service address; traffic sent to the proxy port directly must report none; UDP
// replies must reach a client connected to the service address (conntrack un-NATs them).
func TestOriginalDestination(t *testing.T) {
	if ns := os.Getenv(netnsEnv); ns != "" {
		originalDestinationInNetns(t, ns)
		return
	}
	testenv.Privileged(t)
	ns := fmt.Sprintf("kup-fwd-%d", os.Getpid())
	run(t, "ip", "netns", "add", ns)
	t.Cleanup(func() { run(t, "ip", "netns", "del", ns) })
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"link", "add", "kup0", "type", "veth", "peer", "name", "kup1"},
		{"link", "set", "kup0", "up"},
		{"link", "set", "kup1", "up"},
		{"addr", "add", "192.0.2.1/24", "dev", "kup0"},
		{"addr", "add", "fd00:2::1/64", "dev", "kup0", "nodad"},
		{"route", "add", "10.96.0.0/16", "dev", "kup0"},
		{"route", "add", "fd00:96::/64", "dev", "kup0"},
	} {
		run(t, "ip", append([]string{"-n", ns}, args...)...)
	}
	cmd := exec.Command("ip", "netns", "exec", ns, os.Args[0], "-test.run=^TestOriginalDestination$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), netnsEnv+"="+ns)
	out, err := cmd.CombinedOutput()
	t.Logf("inside %s:\n%s", ns, out)
	if err != nil {
		t.Fatalf("test inside the namespace: %v", err)
	}
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func originalDestinationInNetns(t *testing.T, ns string) {
	// Refuse to touch iptables unless really inside the namespace made for the test.
	if got := strings.TrimSpace(run(t, "ip", "netns", "identify", fmt.Sprint(os.Getpid()))); got != ns {
		t.Fatalf("not inside network namespace %s (identify says %q)", ns, got)
	}
	for _, tc := range []struct {
		name    string
		proto   string // tcp or udp
		listen  string // proxy listen address (port chosen)
		iptbl   string // iptables or ip6tables; "" for no rule
		target  string // rule target, %d = proxy port
		service string // where the client sends
		// direct: the client sends to the proxy's own address; the Chooser must see no dst.
		direct bool
	}{
		{"TCP IPv4 DNAT", "tcp", "192.0.2.1:0", "iptables", "DNAT --to-destination 192.0.2.1:%d", "10.96.0.10:80", false},
		{"TCP IPv4 REDIRECT to a wildcard listener", "tcp", "0.0.0.0:0", "iptables", "REDIRECT --to-ports %d", "10.96.0.11:80", false},
		{"TCP IPv4 client of a dual-stack listener", "tcp", "[::]:0", "iptables", "DNAT --to-destination 192.0.2.1:%d", "10.96.0.12:80", false},
		{"TCP IPv6 DNAT", "tcp", "[::]:0", "ip6tables", "DNAT --to-destination [fd00:2::1]:%d", "[fd00:96::10]:80", false},
		{"TCP direct", "tcp", "192.0.2.1:0", "", "", "", true},
		{"TCP direct to a dual-stack listener", "tcp", "[::]:0", "", "", "", true},
		{"UDP IPv4 DNAT", "udp", "192.0.2.1:0", "iptables", "DNAT --to-destination 192.0.2.1:%d", "10.96.0.10:53", false},
		{"UDP IPv4 REDIRECT to a wildcard listener", "udp", "0.0.0.0:0", "iptables", "REDIRECT --to-ports %d", "10.96.0.11:53", false},
		{"UDP IPv4 client of a dual-stack listener", "udp", "[::]:0", "iptables", "DNAT --to-destination 192.0.2.1:%d", "10.96.0.12:53", false},
		{"UDP IPv6 DNAT", "udp", "[::]:0", "ip6tables", "DNAT --to-destination [fd00:2::1]:%d", "[fd00:96::10]:53", false},
		{"UDP direct", "udp", "192.0.2.1:0", "", "", "", true},
		{"UDP direct to a dual-stack listener", "udp", "[::]:0", "", "", "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoLeaks(t)
			listen := netip.MustParseAddrPort(tc.listen)
			var service netip.AddrPort
			if !tc.direct {
				service = netip.MustParseAddrPort(tc.service)
			}
			chooser := &fakeChooser{}
			var port uint16
			if tc.proto == "tcp" {
				chooser.Set(forwardtest.StartTCPEcho(t, forwardtest.Loopback("4")))
				ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(listen))
				if err != nil {
					t.Fatal(err)
				}
				p := &TCPProxy{Listener: ln, Chooser: chooser, Log: new(forwardtest.Logger(t)), Loops: newTestLoops(t, 2)}
				done := make(chan error, 1)
				go func() { done <- p.Serve() }()
				t.Cleanup(func() {
					p.Close()
					<-done
				})
				port = forwardtest.ListenerAddr(ln).Port()
			} else {
				chooser.Set(forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), ""))
				conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(listen))
				if err != nil {
					t.Fatal(err)
				}
				p := &UDPProxy{Conn: conn, Chooser: chooser, Log: new(forwardtest.Logger(t))}
				done := make(chan error, 1)
				go func() { done <- p.Serve() }()
				t.Cleanup(func() {
					p.Close()
					<-done
				})
				port = conn.LocalAddr().(*net.UDPAddr).AddrPort().Port()
			}
			target := service
			if tc.direct {
				a := listen.Addr()
				if a.IsUnspecified() {
					a = netip.MustParseAddr("192.0.2.1")
				}
				target = netip.AddrPortFrom(a, port)
			} else {
				rule := append([]string{"OUTPUT", "-p", tc.proto, "-d", service.Addr().String(),
					"--dport", fmt.Sprint(service.Port()), "-j"}, strings.Fields(fmt.Sprintf(tc.target, port))...)
				run(t, tc.iptbl, append([]string{"-t", "nat", "-A"}, rule...)...)
				t.Cleanup(func() { run(t, tc.iptbl, append([]string{"-t", "nat", "-D"}, rule...)...) })
			}

			if tc.proto == "tcp" {
				c := forwardtest.DialTCP(t, target)
				if got, err := forwardtest.RoundTrip(c, []byte("hello")); err != nil || string(got) != "hello" {
					t.Fatalf("round trip: %q, %v", got, err)
				}
			} else {
				c := forwardtest.DialUDP(t, target)
				// The socket is connected to the service address: only a reply whose
				// source conntrack rewrote back to it is delivered.
				if got, err := forwardtest.UDPExchange(c, []byte("hello"), 1, forwardtest.WaitTimeout); err != nil || !bytes.Equal(got, []byte("hello")) {
					t.Fatalf("exchange: %q, %v", got, err)
				}
			}
			calls := chooser.Recorded()
			if len(calls) != 1 || calls[0].Dst != service {
				t.Fatalf("Choose calls %+v, want one with dst %v", calls, service)
			}
			t.Logf("client %v, dst %v", calls[0].Client, calls[0].Dst)
		})
	}
}
