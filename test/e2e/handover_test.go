//go:build linux

package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// TestHandover starts a second proxy while one runs, as a DaemonSet rolling update with
// maxSurge does: the second takes everything over and the first exits. Nothing is dropped: an
// established TCP stream carries on with every byte once and in order, a UDP client keeps its
// endpoint, new connections made all along never fail, the rules (and the proxy ports they
// name) do not change, and the health server answers on its port throughout.
func TestHandover(t *testing.T) {
	t.Run("manifests", func(t *testing.T) {
		n := netns.NewNetwork(t, "e2h")
		node := n.AddNode(t, "hn")
		pods := handoverPods(t, n, node)
		dir := t.TempDir()
		writeManifests(t, dir, pods...)
		testHandover(t, node, n.AddPod(t, node, "hcli"), harness.ProxyConfig{Manifests: dir}, "10.96.7.7:80", "10.96.7.7:53")
	})
	t.Run("API server", func(t *testing.T) {
		n := netns.NewNetwork(t, "e2k")
		c := cluster.Start(t, cluster.Options{Network: n})
		node := n.AddNode(t, "hk")
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := c.CreateNode(ctx, nodeName, node.IP); err != nil {
			t.Fatal(err)
		}
		pods := handoverPods(t, n, node)
		svc := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("web",
			harness.TCPPort("tcp", 80, echoPort), harness.UDPPort("udp", 53, echoPort)))
		var eps []harness.Endpoint
		for _, p := range pods {
			eps = append(eps, harness.Endpoint{IP: p.IP, Node: nodeName})
		}
		harness.ApplySlice(ctx, t, c.Client, harness.Slice(svc, eps...))
		testHandover(t, node, n.AddPod(t, node, "kcli"), harness.ProxyConfig{Kubeconfig: c.Kubeconfig}, harness.Addr(svc, 0), harness.Addr(svc, 1))
	})
}

// handoverPods starts the two echo backends of TestHandover.
func handoverPods(t *testing.T, n *netns.Network, node *netns.Node) []*netns.Pod {
	var pods []*netns.Pod
	for i := 1; i <= 2; i++ {
		p := n.AddPod(t, node, fmt.Sprintf("h%d", i))
		harness.StartEcho(t, p.NS, fmt.Sprintf("p%d", i), echoPort)
		pods = append(pods, p)
	}
	return pods
}

// testHandover is TestHandover on one node whose source (base: Manifests or Kubeconfig) serves
// the service web (webTCP, webUDP) with two endpoints.
func testHandover(t *testing.T, node *netns.Node, clientPod *netns.Pod, base harness.ProxyConfig, webTCP, webUDP string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const healthz, metricsAddr = "127.0.0.1:10256", "127.0.0.1:10249"
	cfg := base
	cfg.NodeName = nodeName
	cfg.HealthzBindAddress, cfg.MetricsBindAddress = healthz, metricsAddr
	cfg.Args = []string{"--iptables-sync-period=" + syncPeriod.String(), "--iptables-min-sync-period=100ms"}
	cfg.Ready = func(ctx context.Context) error {
		_, err := harness.Ask(ctx, clientPod.NS, "tcp", webTCP)
		return err
	}
	dir := t.TempDir()
	first := harness.StartProxy(t, node.NS, cfg)
	rulesBefore := harness.RulesFor(harness.IPTablesSave(t, node.NS), harness.Namespace, "web")
	if len(rulesBefore) == 0 {
		t.Fatal("no rules of web: the case proves nothing")
	}

	stream := startStream(ctx, t, clientPod.NS, webTCP)
	udp := startUDPClient(ctx, t, clientPod.NS, webUDP)
	udpBackend := udp.ask(t, "before")

	// New connections, one every 20 ms, all through the hand-over.
	var asked, failed atomic.Int64
	var firstFailure atomic.Value
	probeCtx, stopProbe := context.WithCancel(ctx)
	var probes sync.WaitGroup
	probes.Go(func() {
		for probeCtx.Err() == nil {
			_, err := harness.AskTimeout(probeCtx, clientPod.NS, "tcp", webTCP, 3*time.Second)
			if probeCtx.Err() != nil {
				return
			}
			asked.Add(1)
			if err != nil {
				failed.Add(1)
				firstFailure.CompareAndSwap(nil, err.Error())
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	healthFails := probeHealth(probeCtx, node.NS, healthz, &probes)

	time.Sleep(300 * time.Millisecond) // traffic before the hand-over
	started := time.Now()
	secondCfg := cfg
	secondCfg.Ready = func(ctx context.Context) error {
		select {
		case <-first.Done():
		default:
			return fmt.Errorf("the first proxy still runs")
		}
		_, err := harness.Ask(ctx, clientPod.NS, "tcp", webTCP)
		return err
	}
	second := harness.StartProxy(t, node.NS, secondCfg)
	t.Logf("MEASURE hand-over: the first proxy exited and the second answered %v after the second started", time.Since(started).Round(time.Millisecond))
	if err := first.Err(); err != nil {
		t.Errorf("the first proxy exited with %v, want 0; its log:\n%s", err, first.Tail(30))
	}
	if !strings.Contains(first.Log(), "handed over to the successor") {
		t.Errorf("the first proxy's log does not say it handed over:\n%s", first.Tail(30))
	}
	if !strings.Contains(second.Log(), "adopted what the predecessor handed over") {
		t.Errorf("the second proxy's log does not say it adopted anything:\n%s", second.Tail(30))
	}

	// The successor's metrics say what moved (the metrics socket is the one handed over).
	if m, err := harness.ScrapeMetrics(node.NS, metricsAddr); err != nil {
		t.Errorf("scraping the second proxy's metrics: %v", err)
	} else {
		if got := m[`kube_userspace_proxy_handovers_total{result="completed",role="successor"}`]; got != 1 {
			t.Errorf("the second proxy counts %v completed hand-overs as successor, want 1", got)
		}
		for _, kind := range []string{"listener", "tcp-conn", "udp-session", "server"} {
			if got := m[`kube_userspace_proxy_handover_records_total{kind="`+kind+`",role="successor"}`]; got < 1 {
				t.Errorf("the second proxy counts %v handed-over records of kind %s, want ≥ 1", got, kind)
			}
		}
		t.Logf("MEASURE hand-over duration (successor's hello to release): %.3fs; TCP connections moved: %v, UDP sessions: %v",
			m[`kube_userspace_proxy_handover_duration_seconds_sum{role="successor"}`],
			m[`kube_userspace_proxy_handover_records_total{kind="tcp-conn",role="successor"}`],
			m[`kube_userspace_proxy_handover_records_total{kind="udp-session",role="successor"}`])
	}

	time.Sleep(500 * time.Millisecond) // traffic after the hand-over
	stopProbe()
	probes.Wait()
	t.Logf("MEASURE new connections during the hand-over: %d of %d failed; health checks failed: %d", failed.Load(), asked.Load(), healthFails.Load())
	if failed.Load() > 0 {
		t.Errorf("%d of %d new connections failed during the hand-over (first: %v)", failed.Load(), asked.Load(), firstFailure.Load())
	}
	if asked.Load() < 10 {
		t.Errorf("only %d connections asked: the probe proves little", asked.Load())
	}
	if healthFails.Load() > 0 {
		t.Errorf("the health server failed %d times during the hand-over (first %s)", healthFails.Load(), healthFails)
	}
	if err := stream.finish(); err != nil {
		t.Errorf("the established stream: %v", err)
	}
	if got := udp.ask(t, "after"); got != udpBackend {
		t.Errorf("UDP client answered by %s after the hand-over, %s before", got, udpBackend)
	}
	if after := harness.RulesFor(harness.IPTablesSave(t, node.NS), harness.Namespace, "web"); strings.Join(after, "\n") != strings.Join(rulesBefore, "\n") {
		t.Errorf("the rules of web changed in the hand-over:\nbefore:\n%s\nafter:\n%s", strings.Join(rulesBefore, "\n"), strings.Join(after, "\n"))
	}

	// A successor that cannot take over (here: it looks for the hand-over socket elsewhere, as
	// a build without hand-over would not answer) leaves the running proxy alone, waits for it
	// to exit, then serves: the node is never left without a proxy.
	thirdCfg := cfg
	thirdCfg.Args = append(append([]string(nil), cfg.Args...), "--handover-socket="+dir+"/nobody.sock")
	third := node.NS.Start(t, harness.ProxyArgs(t, thirdCfg)...)
	harness.WaitFor(t, 30*time.Second, func() error {
		if !strings.Contains(third.Log(), "falling back to a restart") {
			return fmt.Errorf("the third proxy has not given up the hand-over yet")
		}
		return nil
	})
	if _, err := harness.Ask(ctx, clientPod.NS, "tcp", webTCP); err != nil {
		t.Errorf("the running proxy stopped serving when a successor could not take over: %v", err)
	}
	if after := harness.RulesFor(harness.IPTablesSave(t, node.NS), harness.Namespace, "web"); strings.Join(after, "\n") != strings.Join(rulesBefore, "\n") {
		t.Errorf("a waiting successor changed the rules of web:\n%s", strings.Join(after, "\n"))
	}
	if err := second.Terminate(30 * time.Second); err != nil {
		t.Errorf("stopping the second proxy: %v", err)
	}
	stopped := time.Now()
	harness.WaitFor(t, 30*time.Second, func() error {
		_, err := harness.AskTimeout(ctx, clientPod.NS, "tcp", webTCP, time.Second)
		return err
	})
	t.Logf("MEASURE a waiting successor served %v after the running proxy exited", time.Since(stopped).Round(time.Millisecond))
	if err := syscall.Kill(third.Pid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-third.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("the third proxy did not exit on SIGTERM")
	}
	if left := harness.RulesFor(harness.IPTablesSave(t, node.NS), harness.Namespace, "web"); len(left) != 0 {
		t.Errorf("%d rules of web left after the last proxy stopped", len(left))
	}
}

// stream is an established TCP connection to a kup-echo service, carrying numbered lines and
// checking they come back ("backend peer line"), each once, in order, from one backend, until
// finish.
type stream struct {
	conn    net.Conn
	backend string
	stop    chan struct{}
	done    chan error
	sent    atomic.Int64
}

func startStream(ctx context.Context, t *testing.T, ns *netns.NS, addr string) *stream {
	t.Helper()
	conn, err := ns.DialContext(ctx, "tcp", addr)
	if err != nil {
		t.Fatalf("stream: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	r := bufio.NewReader(conn)
	s := &stream{conn: conn, stop: make(chan struct{}), done: make(chan error, 1)}
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		for i := 0; ; i++ {
			select {
			case <-s.stop:
				return
			default:
			}
			line := streamLine(i)
			_ = conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
			if _, err := conn.Write([]byte(line)); err != nil {
				return
			}
			s.sent.Store(int64(i + 1))
			time.Sleep(2 * time.Millisecond)
		}
	}()
	go func() { s.done <- s.check(r, writerDone) }()
	return s
}

// check reads the echoed lines until every line the writer sent (once it is done) is back.
func (s *stream) check(r *bufio.Reader, writerDone <-chan struct{}) error {
	for i := int64(0); ; i++ {
		select {
		case <-writerDone:
			if i == s.sent.Load() {
				return nil
			}
		default:
		}
		_ = s.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		line, err := r.ReadString('\n')
		if err != nil {
			select {
			case <-writerDone: // it finished while this read waited for a line that never came
				if i == s.sent.Load() {
					return nil
				}
			default:
			}
			return fmt.Errorf("after %d of %d lines: %w", i, s.sent.Load(), err)
		}
		f := strings.SplitN(line, " ", 3)
		if len(f) != 3 {
			return fmt.Errorf("answer %d malformed: %.60q", i, line)
		}
		if s.backend == "" {
			s.backend = f[0]
		}
		if want := streamLine(int(i)); f[0] != s.backend || f[2] != want {
			return fmt.Errorf("line %d came back from %s as %.30q… (%d bytes), want %.30q… (%d bytes) from %s", i, f[0], f[2], len(f[2]), want, len(want), s.backend)
		}
	}
}

// streamLine is the stream's line i: lengths vary, some lines large, so that data sits in
// buffers and pipes.
func streamLine(i int) string { return fmt.Sprintf("%08d %s\n", i, strings.Repeat("x", (i*37)%4000)) }

// finish stops writing, waits for every line to come back and reports what went wrong.
func (s *stream) finish() error {
	close(s.stop)
	select {
	case err := <-s.done:
		if err == nil && s.sent.Load() < 100 {
			return fmt.Errorf("only %d lines sent: the stream proves little", s.sent.Load())
		}
		return err
	case <-time.After(30 * time.Second):
		return fmt.Errorf("lines sent: %d; not all came back within 30s", s.sent.Load())
	}
}

// udpClient is one UDP socket (one client address: one session) asking an echo service.
type udpClient struct {
	pc   net.PacketConn
	addr *net.UDPAddr
}

func startUDPClient(_ context.Context, t *testing.T, ns *netns.NS, addr string) *udpClient {
	t.Helper()
	pc, err := ns.ListenPacket("udp4", ":0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	ua, err := net.ResolveUDPAddr("udp4", addr)
	if err != nil {
		t.Fatal(err)
	}
	return &udpClient{pc: pc, addr: ua}
}

// ask sends a datagram and returns the answering backend's name.
func (u *udpClient) ask(t *testing.T, payload string) string {
	t.Helper()
	buf := make([]byte, 2048)
	for attempt := range 5 {
		if _, err := u.pc.WriteTo([]byte(payload), u.addr); err != nil {
			t.Fatal(err)
		}
		_ = u.pc.SetReadDeadline(time.Now().Add(time.Second))
		n, _, err := u.pc.ReadFrom(buf)
		if err == nil {
			backend, _, _ := strings.Cut(string(buf[:n]), " ")
			return backend
		}
		t.Logf("UDP ask %q, attempt %d: %v", payload, attempt+1, err)
	}
	t.Fatalf("UDP: no answer to %q", payload)
	return ""
}

// healthProbe counts the health server's failures and keeps the first.
type healthProbe struct {
	fails atomic.Int64
	first atomic.Value // string: when and how the first failure failed
}

// Load returns the number of failures.
func (h *healthProbe) Load() int64 { return h.fails.Load() }

// String describes the first failure.
func (h *healthProbe) String() string {
	if v, ok := h.first.Load().(string); ok {
		return v
	}
	return "none"
}

// probeHealth asks the health server every 50 ms until ctx ends and counts the failures.
func probeHealth(ctx context.Context, ns *netns.NS, addr string, wg *sync.WaitGroup) *healthProbe {
	var h healthProbe
	client := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{DialContext: ns.DialContext, DisableKeepAlives: true}}
	wg.Go(func() {
		for ctx.Err() == nil {
			start := time.Now()
			resp, err := client.Get("http://" + addr + "/livez")
			if ctx.Err() != nil {
				return
			}
			if err != nil {
				h.fails.Add(1)
				h.first.CompareAndSwap(nil, fmt.Sprintf("at %s after %v: %v", start.UTC().Format("15:04:05.000"), time.Since(start).Round(time.Millisecond), err))
			} else {
				resp.Body.Close()
			}
			time.Sleep(50 * time.Millisecond)
		}
	})
	return &h
}
