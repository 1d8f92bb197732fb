//go:build linux

package transparent

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables/netnstest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/tcp"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/udp"
)

func testLogger(t testing.TB) zerolog.Logger {
	return zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.DebugLevel)
}

// nsRules is Rules whose every command (iptables and ip) runs inside ns.
type nsRules struct {
	r  *Rules
	ns *netnstest.NS
	t  *testing.T
}

func (n nsRules) Ensure(ctx context.Context) (err error) {
	n.ns.Do(n.t, func() { err = n.r.Ensure(ctx) })
	return err
}

func (n nsRules) Cleanup(ctx context.Context) (err error) {
	n.ns.Do(n.t, func() { err = n.r.Cleanup(ctx) })
	return err
}

// newRules returns Rules for family and mode that run inside ns.
func newRules(t *testing.T, ns *netnstest.NS, fam iptables.Family, mode iptables.Mode) nsRules {
	t.Helper()
	netnstest.RequireTools(t, "Debian packages iptables and iproute2", "iptables-nft", "iptables-legacy", "ip")
	run, err := iptables.New(iptables.Options{Family: fam, Mode: mode})
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(Options{Runner: run, Log: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	return nsRules{r: r, ns: ns, t: t}
}

// state is what the namespace holds of ours: the mangle table, the ip rules and our table.
func state(t *testing.T, ns *netnstest.NS, fam iptables.Family, mode iptables.Mode) (mangle, rules, routes string) {
	t.Helper()
	save, fflag := "iptables-"+string(mode)+"-save", "-4"
	if fam == iptables.IPv6 {
		save, fflag = "ip6tables-"+string(mode)+"-save", "-6"
	}
	mangle = ns.MustExec(t, save, "-t", "mangle")
	rules = ns.MustExec(t, "ip", fflag, "rule", "list")
	routes, _ = ns.Exec("ip", fflag, "route", "show", "table", fmt.Sprint(DefaultTable))
	return mangle, rules, routes
}

// TestEnsureCleanup programs the rules twice (idempotent), checks each piece, then removes them
// and checks that nothing of ours is left, for both families and both iptables backends.
func TestEnsureCleanup(t *testing.T) {
	for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			t.Run(fmt.Sprintf("%s/%v", mode, fam), func(t *testing.T) {
				ns := netnstest.New(t)
				r := newRules(t, ns, fam, mode)
				ctx := context.Background()
				for range 2 {
					if err := r.Ensure(ctx); err != nil {
						t.Fatal(err)
					}
				}
				mangle, rules, routes := state(t, ns, fam, mode)
				for _, want := range []string{"-A PREROUTING -m comment --comment \"kube-userspace-proxy transparent sockets\" -j " + Chain,
					"-m socket --transparent", "--set-xmark 0x1000/0x1000"} {
					if strings.Count(mangle, want) != 1 {
						t.Errorf("mangle table has %q %d times, want once:\n%s", want, strings.Count(mangle, want), mangle)
					}
				}
				if strings.Count(rules, "fwmark 0x1000/0x1000 lookup 9050") != 1 || !strings.Contains(rules, "9050:") {
					t.Errorf("ip rules:\n%s", rules)
				}
				if !strings.Contains(routes, "local default dev lo") {
					t.Errorf("table %d: %q, want the local default route", DefaultTable, routes)
				}

				// Someone removes the ip rule: Ensure puts it back.
				fflag := map[iptables.Family]string{iptables.IPv4: "-4", iptables.IPv6: "-6"}[fam]
				ns.MustExec(t, "ip", fflag, "rule", "del", "priority", "9050")
				if err := r.Ensure(ctx); err != nil {
					t.Fatal(err)
				}
				if _, rules, _ := state(t, ns, fam, mode); !strings.Contains(rules, "fwmark 0x1000/0x1000 lookup 9050") {
					t.Errorf("rule not restored:\n%s", rules)
				}

				for range 2 { // the second Cleanup finds nothing and succeeds
					if err := r.Cleanup(ctx); err != nil {
						t.Fatal(err)
					}
				}
				mangle, rules, routes = state(t, ns, fam, mode)
				if strings.Contains(mangle, Chain) || strings.Contains(mangle, "socket") {
					t.Errorf("mangle table after cleanup:\n%s", mangle)
				}
				if strings.Contains(rules, "9050") {
					t.Errorf("ip rules after cleanup:\n%s", rules)
				}
				if strings.TrimSpace(routes) != "" {
					t.Errorf("table %d after cleanup: %q", DefaultTable, routes)
				}
			})
		}
	}
}

// chooser sends everything to one endpoint, transparently.
type chooser struct{ ep netip.AddrPort }

func (c chooser) Choose(_, _ netip.AddrPort, _ bool) (forward.Target, error) {
	return forward.Target{Endpoint: c.ep, Transparent: true}, nil
}

// flowNet is client ─ node ─ pod: the client reaches the proxy on the node, the proxy reaches the
// pod, whose default route is the node (which does not forward).
type flowNet struct {
	client, node, pod *netnstest.NS
	clientIP, nodeIP  netip.Addr // on the client link
	podIP             netip.Addr
}

func newFlowNet(t *testing.T) *flowNet {
	n := &flowNet{client: netnstest.New(t), node: netnstest.New(t), pod: netnstest.New(t),
		clientIP: netip.MustParseAddr("10.1.0.2"), nodeIP: netip.MustParseAddr("10.1.0.1"),
		podIP: netip.MustParseAddr("10.2.0.2")}
	netnstest.Connect(t, n.node, "kupn0", []netip.Prefix{netip.MustParsePrefix("10.1.0.1/24")},
		n.client, "kupc0", []netip.Prefix{netip.MustParsePrefix("10.1.0.2/24")})
	netnstest.Connect(t, n.node, "kupn1", []netip.Prefix{netip.MustParsePrefix("10.2.0.1/24")},
		n.pod, "kupp0", []netip.Prefix{netip.MustParsePrefix("10.2.0.2/24")})
	n.pod.IP(t, "route", "add", "default", "via", "10.2.0.1")
	n.client.IP(t, "route", "add", "default", "via", "10.1.0.1")
	return n
}

// startPeerServer runs, in the pod, a TCP and a UDP server on port 8080 that answer each
// connection or datagram with the peer address they see.
func startPeerServer(t *testing.T, pod *netnstest.NS) {
	var ln net.Listener
	var pc net.PacketConn
	pod.Do(t, func() {
		var err error
		if ln, err = net.Listen("tcp4", "10.2.0.2:8080"); err != nil {
			t.Fatal(err)
		}
		if pc, err = net.ListenPacket("udp4", "10.2.0.2:8080"); err != nil {
			t.Fatal(err)
		}
	})
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); pc.Close(); wg.Wait() })
	wg.Add(2)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			fmt.Fprintf(c, "%s\n", c.RemoteAddr())
			c.Close()
		}
	}()
	go func() {
		defer wg.Done()
		buf := make([]byte, 1500)
		for {
			_, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo([]byte(from.String()), from)
		}
	}()
}

// childEnv makes the test binary run as the proxy process of TestTransparentFlow.
const childEnv = "KUP_TRANSPARENT_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "proxy" {
		os.Exit(proxyChild())
	}
	os.Exit(m.Run())
}

// proxyChild runs a transparent TCP and UDP proxy at 10.1.0.1:9000 to the pod at
// 10.2.0.2:8080 until its stdin closes. It runs as a process of its own inside the node's
// namespace: the proxies' goroutines, which dial the pod, would not be in the namespace if it
// ran in the test process.
func proxyChild() int {
	ep := netip.MustParseAddrPort("10.2.0.2:8080")
	ln, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(10, 1, 0, 1), Port: 9000})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	uc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(10, 1, 0, 1), Port: 9000})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	log := zerolog.New(os.Stderr).Level(zerolog.DebugLevel)
	loops, err := tcp.NewLoops(1)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer loops.Close()
	tp := &tcp.Proxy{Listener: ln, Loops: loops, Chooser: chooser{ep}, Log: &log, DialTimeouts: []time.Duration{time.Second}}
	up := &udp.Proxy{Conn: uc, Chooser: chooser{ep}, Log: &log}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		if err := tp.Serve(); err != nil {
			fmt.Fprintln(os.Stderr, "TCP proxy:", err)
		}
	}()
	go func() { defer wg.Done(); up.Serve() }()
	fmt.Println("READY")
	io.Copy(io.Discard, os.Stdin)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	tp.Shutdown(ctx)
	up.Close()
	wg.Wait()
	return 0
}

// startProxies runs proxyChild in the node's namespace until the test ends.
func startProxies(t *testing.T, n *flowNet) {
	cmd := exec.Command("ip", "netns", "exec", n.node.Name, os.Args[0])
	cmd.Env = append(os.Environ(), childEnv+"=proxy")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("proxy child: %v", err)
			}
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
			t.Errorf("proxy child did not stop")
		}
		t.Logf("proxy child's log:\n%s", stderr.String())
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "READY" {
		t.Fatalf("proxy child said %q, %v", line, err)
	}
}

// askTCP connects from the client to the proxy and returns the pod's answer (or the error).
func askTCP(t *testing.T, n *flowNet) (string, error) {
	var c net.Conn
	var err error
	n.client.Do(t, func() {
		c, err = net.DialTimeout("tcp4", "10.1.0.1:9000", 5*time.Second)
	})
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

// askUDP sends datagrams from the client to the proxy until the pod answers.
func askUDP(t *testing.T, n *flowNet) (string, error) {
	var c net.Conn
	var err error
	n.client.Do(t, func() { c, err = net.Dial("udp4", "10.1.0.1:9000") })
	if err != nil {
		return "", err
	}
	defer c.Close()
	buf := make([]byte, 1500)
	for range 5 {
		if _, err := c.Write([]byte("who")); err != nil {
			return "", err
		}
		c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		k, err := c.Read(buf)
		if err == nil {
			return string(buf[:k]), nil
		}
	}
	return "", fmt.Errorf("no UDP answer")
}

// TestTransparentFlow proves the whole path in the kernel: with the rules, the pod sees the
// client's own address for TCP and UDP; after Cleanup, transparent connections can no longer be
// answered (the replies are forwarded away, not delivered), which shows the rules are what
// delivers them.
func TestTransparentFlow(t *testing.T) {
	for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		t.Run(string(mode), func(t *testing.T) {
			n := newFlowNet(t)
			r := newRules(t, n.node, iptables.IPv4, mode)
			ctx := context.Background()
			if err := r.Ensure(ctx); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { r.Cleanup(ctx) })
			startPeerServer(t, n.pod)
			startProxies(t, n)

			got, err := askTCP(t, n)
			if err != nil {
				t.Fatalf("TCP through the transparent proxy: %v", err)
			}
			if ap, perr := netip.ParseAddrPort(got); perr != nil || ap.Addr() != n.clientIP {
				t.Errorf("TCP: pod saw %q, want the client's address %v", got, n.clientIP)
			}
			got, err = askUDP(t, n)
			if err != nil {
				t.Fatalf("UDP through the transparent proxy: %v", err)
			}
			if ap, perr := netip.ParseAddrPort(got); perr != nil || ap.Addr() != n.clientIP {
				t.Errorf("UDP: pod saw %q, want the client's address %v", got, n.clientIP)
			}

			if err := r.Cleanup(ctx); err != nil {
				t.Fatal(err)
			}
			if got, err := askTCP(t, n); err == nil {
				t.Errorf("TCP without the rules: pod answered %q; want no answer (replies not delivered)", got)
			}
		})
	}
}
