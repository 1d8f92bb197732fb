//go:build linux

package forward

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
)

// sockaddrBytes encodes ap as the kernel does in a struct sockaddr_in / sockaddr_in6.
func sockaddrBytes(ap netip.AddrPort) []byte {
	if ap.Addr().Is4() {
		b := make([]byte, unix.SizeofSockaddrInet4)
		binary.NativeEndian.PutUint16(b, unix.AF_INET)
		binary.BigEndian.PutUint16(b[2:], ap.Port())
		a := ap.Addr().As4()
		copy(b[4:], a[:])
		return b
	}
	b := make([]byte, unix.SizeofSockaddrInet6)
	binary.NativeEndian.PutUint16(b, unix.AF_INET6)
	binary.BigEndian.PutUint16(b[2:], ap.Port())
	a := ap.Addr().As16()
	copy(b[8:], a[:])
	return b
}

// cmsg encodes one control message as recvmsg(2) fills it in.
func cmsg(level, typ int, data []byte) []byte { return appendCmsg(nil, level, typ, data) }

func TestOrigDstFromOOB(t *testing.T) {
	v4 := netip.MustParseAddrPort("10.96.0.10:53")
	v6 := netip.MustParseAddrPort("[fd00:96::10]:53")
	mapped := netip.AddrPortFrom(netip.AddrFrom16(v4.Addr().As16()), 53)
	for _, tc := range []struct {
		name string
		oob  []byte
		want netip.AddrPort
	}{
		{"empty", nil, netip.AddrPort{}},
		{"IPv4", cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, sockaddrBytes(v4)), v4},
		{"IPv6", cmsg(unix.SOL_IPV6, unix.IPV6_ORIGDSTADDR, sockaddrBytes(v6)), v6},
		{"IPv4-mapped IPv6 is unmapped", cmsg(unix.SOL_IPV6, unix.IPV6_ORIGDSTADDR, sockaddrBytes(mapped)), v4},
		{"after another message", append(cmsg(unix.SOL_IP, unix.IP_TTL, []byte{64, 0, 0, 0}), cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, sockaddrBytes(v4))...), v4},
		{"other message only", cmsg(unix.SOL_IP, unix.IP_TTL, []byte{64, 0, 0, 0}), netip.AddrPort{}},
		{"truncated header", cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, sockaddrBytes(v4))[:8], netip.AddrPort{}},
		{"truncated address", cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, sockaddrBytes(v4)[:6]), netip.AddrPort{}},
		{"wrong family", cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, make([]byte, 16)), netip.AddrPort{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := origDstFromOOB(tc.oob); got != tc.want {
				t.Errorf("origDstFromOOB = %v, want %v", got, tc.want)
			}
		})
	}
}

// FuzzOrigDstFromOOB checks the hand-written parser against x/sys/unix's on arbitrary input:
// it must never panic, and must find what ParseSocketControlMessage finds.
func FuzzOrigDstFromOOB(f *testing.F) {
	f.Add(cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, sockaddrBytes(netip.MustParseAddrPort("10.0.0.1:80"))))
	f.Add(cmsg(unix.SOL_IPV6, unix.IPV6_ORIGDSTADDR, sockaddrBytes(netip.MustParseAddrPort("[::1]:80"))))
	f.Add(append(cmsg(unix.SOL_IP, unix.IP_TTL, []byte{1, 0, 0, 0}), cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, sockaddrBytes(netip.MustParseAddrPort("10.0.0.1:80")))...))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, oob []byte) {
		got := origDstFromOOB(oob)
		msgs, err := unix.ParseSocketControlMessage(oob)
		if err != nil {
			return // malformed: any answer is acceptable, as long as there was no panic
		}
		var want netip.AddrPort
		for _, m := range msgs {
			if (m.Header.Level == unix.SOL_IP && m.Header.Type == unix.IP_ORIGDSTADDR) ||
				(m.Header.Level == unix.SOL_IPV6 && m.Header.Type == unix.IPV6_ORIGDSTADDR) {
				if ap, ok := parseSockaddr(m.Data); ok {
					want = unmapAddrPort(ap)
					break
				}
			}
		}
		if got != want && want.IsValid() {
			t.Errorf("origDstFromOOB = %v, ParseSocketControlMessage finds %v", got, want)
		}
	})
}

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
				chooser.set(startTCPEcho(t, loopback("4")))
				ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(listen))
				if err != nil {
					t.Fatal(err)
				}
				p := &TCPProxy{Listener: ln, Chooser: chooser, Log: new(testLogger(t)), Loops: newTestLoops(t, 2)}
				done := make(chan error, 1)
				go func() { done <- p.Serve() }()
				t.Cleanup(func() {
					p.Close()
					<-done
				})
				port = listenerAddr(ln).Port()
			} else {
				chooser.set(startUDPEcho(t, loopback("4"), ""))
				conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(listen))
				if err != nil {
					t.Fatal(err)
				}
				p := &UDPProxy{Conn: conn, Chooser: chooser, Log: new(testLogger(t))}
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
				c := dialTCPTest(t, target)
				if got, err := roundTrip(c, []byte("hello")); err != nil || string(got) != "hello" {
					t.Fatalf("round trip: %q, %v", got, err)
				}
			} else {
				c := dialUDPTest(t, target)
				// The socket is connected to the service address: only a reply whose
				// source conntrack rewrote back to it is delivered.
				if got, err := udpExchange(c, []byte("hello"), 1, waitTimeout); err != nil || !bytes.Equal(got, []byte("hello")) {
					t.Fatalf("exchange: %q, %v", got, err)
				}
			}
			calls := chooser.recorded()
			if len(calls) != 1 || calls[0].dst != service {
				t.Fatalf("Choose calls %+v, want one with dst %v", calls, service)
			}
			t.Logf("client %v, dst %v", calls[0].client, calls[0].dst)
		})
	}
}
