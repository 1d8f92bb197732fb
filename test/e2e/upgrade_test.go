//go:build linux

package e2e

import (
	"bufio"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// upgrades is how many hand-overs TestUpgrade makes in a row.
const upgrades = 10

// newConnsPerUpgrade is how many new connections the probe asks, at least, from the start of one
// upgrade to the start of the next.
const newConnsPerUpgrade = 50

// currentUpgrade is the upgrade under way (or last done), for messages.
var currentUpgrade atomic.Int64

// TestUpgrade upgrades a node's proxy: an old binary hands everything over to a new
// binary, then the new one to itself started with other flags, and so on, ten times in a row,
// alternating the two binaries (both built from the tree, stamped with different versions),
// while the node carries: 20 TCP streams sending numbered, hashed data both ways without pause,
// a half-closed stream still receiving, a transparent-mode stream from an outside client to an
// externalTrafficPolicy: Local NodePort, a UDP flow on one kept socket, a ClientIP-affinity
// client and a new connection every 10 ms. Nothing may be reset, lost, duplicated or reordered,
// no new connection may fail, the affinity client and the UDP flow keep their endpoints, each
// old process exits after handing over, and after ten upgrades the proxy holds no more
// descriptors or goroutines than after two (with the same traffic) and the rules are the same,
// byte for byte.
func TestUpgrade(t *testing.T) {
	begin := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	// The two binaries, built while the control plane starts.
	binDir := t.TempDir()
	var bins [2]string
	var buildErr error
	built := make(chan struct{})
	go func() {
		defer close(built)
		bins[0], buildErr = buildProxyVersion(binDir, "upgrade-old")
		if buildErr == nil {
			bins[1], buildErr = buildProxyVersion(binDir, "upgrade-new")
		}
	}()
	harness.EchoBinary(t) // builds kup-echo (and the harness's proxy) meanwhile

	n := netns.NewNetwork(t, "e2u")
	c := cluster.Start(t, cluster.Options{Network: n})
	node := n.AddNode(t, "un")
	if _, err := c.CreateNode(ctx, nodeName, node.IP); err != nil {
		t.Fatal(err)
	}
	var eps []harness.Endpoint
	podByName := map[string]*netns.Pod{}
	for i := 1; i <= 3; i++ {
		name := fmt.Sprintf("u%d", i)
		p := n.AddPod(t, node, name)
		harness.StartEcho(t, p.NS, name, echoPort)
		podByName[name] = p
		eps = append(eps, harness.Endpoint{IP: p.IP, Node: nodeName, Name: name})
	}
	cli := n.AddPod(t, node, "ucli")
	affCli := n.AddPod(t, node, "uaff")
	outside := n.AddClient(t, "uout")

	web := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("web",
		harness.TCPPort("tcp", 80, echoPort), harness.UDPPort("udp", 53, echoPort)))
	harness.ApplySlice(ctx, t, c.Client, harness.Slice(web, eps...))
	sticky := harness.ClusterIPService("sticky", harness.TCPPort("tcp", 80, echoPort))
	sticky.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
	sticky = harness.CreateService(ctx, t, c.Client, sticky)
	harness.ApplySlice(ctx, t, c.Client, harness.Slice(sticky, eps...))
	local := harness.NodePortService("local", harness.TCPPort("tcp", 80, echoPort))
	local.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	local = harness.CreateService(ctx, t, c.Client, local)
	harness.ApplySlice(ctx, t, c.Client, harness.Slice(local, eps...))
	webTCP, webUDP, stickyTCP := harness.Addr(web, 0), harness.Addr(web, 1), harness.Addr(sticky, 0)
	localTCP := harness.NodePortAddr(node.IP, local, 0)

	<-built
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	t.Logf("fixture and binaries ready in %v", time.Since(begin).Round(time.Millisecond))

	const healthz, metricsAddr = "127.0.0.1:10256", "127.0.0.1:10249"
	base := harness.ProxyConfig{
		NodeName: nodeName, Kubeconfig: c.Kubeconfig,
		HealthzBindAddress: healthz, MetricsBindAddress: metricsAddr,
	}
	// flags[0] is how the old binary runs; flags[1] the "different flags" of the second
	// upgrade on.
	flags := [2]harness.ProxyConfig{base, base}
	flags[0].Args = []string{"--iptables-sync-period=" + syncPeriod.String(), "--iptables-min-sync-period=100ms",
		"--nodeport-addresses=" + n.Subnet().String()}
	flags[1].LogLevel = "info"
	flags[1].Args = []string{"--iptables-sync-period=5s", "--iptables-min-sync-period=250ms",
		"--nodeport-addresses=" + n.Subnet().String(), "--udp-timeout=45s"}

	cur := startProxyBinary(t, node.NS, bins[0], flags[0], func(ctx context.Context) error {
		for _, ask := range []struct {
			ns   *netns.NS
			addr string
		}{{cli.NS, webTCP}, {affCli.NS, stickyTCP}, {outside.NS, localTCP}} {
			if _, err := harness.Ask(ctx, ask.ns, "tcp", ask.addr); err != nil {
				return err
			}
		}
		return nil
	})
	time.Sleep(time.Second) // a settled sync
	rulesBefore := upgradeRules(t, node)
	if !strings.Contains(rulesBefore, "default/web") || !strings.Contains(rulesBefore, "KUBE-PORTALS-TRANSPARENT") {
		t.Fatalf("the rules lack web or the transparent routing: the case proves nothing:\n%s", rulesBefore)
	}

	// The traffic, all of it until the end.
	var streams []*checkedStream
	for i := range 20 {
		streams = append(streams, startCheckedStream(ctx, t, fmt.Sprintf("s%02d", i), cli.NS, webTCP, netip.Addr{}))
	}
	transp := startCheckedStream(ctx, t, "transparent", outside.NS, localTCP, outside.IP)
	streams = append(streams, transp)
	half := startHalfClosed(ctx, t, cli.NS, webTCP)
	udp := startUDPFlow(t, cli.NS, webUDP)

	trafficCtx, stopTraffic := context.WithCancel(ctx)
	var traffic sync.WaitGroup
	newConns := probeNewConnections(trafficCtx, &traffic, cli.NS, webTCP, 10*time.Millisecond)
	aff := probeAffinity(trafficCtx, &traffic, affCli.NS, stickyTCP, 25*time.Millisecond)
	healthFails := probeHealth(trafficCtx, node.NS, healthz, &traffic)
	var udpWG sync.WaitGroup
	udpWG.Go(func() { udp.run(trafficCtx) })
	defer func() { // on a t.Fatal below: stop the traffic before the cleanups kill everything
		stopTraffic()
		traffic.Wait()
		udpWG.Wait()
	}()

	// The half-close must have reached the backend before the first upgrade.
	harness.WaitFor(t, 10*time.Second, func() error {
		if !half.sawEOF.Load() {
			return errors.New("the backend has not seen the half-closed stream's EOF")
		}
		return nil
	})
	time.Sleep(500 * time.Millisecond) // traffic before the first upgrade

	type leakSample struct{ fds, pipes, goroutines int }
	var samples []leakSample
	var handovers []time.Duration
	for i := 1; i <= upgrades; i++ {
		// Upgrade 1: old binary → new binary, same flags; upgrade 2: new binary with other
		// flags; then the two binaries alternate, the old with its flags, the new with the
		// other ones (so the proxies after upgrades 2 and 10 run alike).
		bin, cfg := bins[1], flags[0]
		switch {
		case i == 2 || i > 2 && i%2 == 0:
			cfg = flags[1]
		case i > 2:
			bin = bins[0]
		}
		currentUpgrade.Store(int64(i))
		askedBefore := newConns.asked.Load()
		prev := cur
		progress := snapshotProgress(streams, half, udp)
		started := time.Now()
		cur = startProxyBinary(t, node.NS, bin, cfg, func(ctx context.Context) error {
			select {
			case <-prev.Done():
			default:
				return errors.New("the old proxy still runs")
			}
			_, err := harness.Ask(ctx, cli.NS, "tcp", webTCP)
			return err
		})
		took := time.Since(started)
		handovers = append(handovers, took)
		t.Logf("MEASURE upgrade %d (%s → %s, %s): the old proxy exited and the new one answered %v after the new one started",
			i, filepath.Base(prev.Args[0]), filepath.Base(bin), strings.Join(cfg.Args[:2], " "), took.Round(time.Millisecond))
		checkHandedOver(t, i, prev, cur, bin)
		waitProgress(t, i, progress, streams, half, udp)
		if got := upgradeRules(t, node); got != rulesBefore {
			t.Errorf("upgrade %d changed the rules:\nbefore:\n%s\nafter:\n%s", i, rulesBefore, got)
		}
		if i == 2 || i == upgrades {
			// The long-lived traffic goes on; the probes pause, so that no short connection
			// is open at the instant of a sample.
			newConns.pause(true)
			aff.pause(true)
			s := leakSample{fds: minOver(func() (int, error) { fds, _, err := countFDs(cur.Pid()); return fds, err }),
				pipes:      minOver(func() (int, error) { _, pipes, err := countFDs(cur.Pid()); return pipes, err }),
				goroutines: minOver(func() (int, error) { return goroutines(node.NS, metricsAddr) })}
			newConns.pause(false)
			aff.pause(false)
			t.Logf("MEASURE after upgrade %d: %d descriptors (and %d of pipes: the splice pipe pools), %d goroutines (pid %d)", i, s.fds, s.pipes, s.goroutines, cur.Pid())
			samples = append(samples, s)
		}
		// Traffic between upgrades: at least 200 ms and newConnsPerUpgrade new connections since
		// this one began (a hand-over takes ~0.1 s now: the probes are counted, not timed).
		time.Sleep(200 * time.Millisecond)
		for deadline := time.Now().Add(10 * time.Second); newConns.asked.Load() < askedBefore+newConnsPerUpgrade && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
	}
	stopTraffic()
	traffic.Wait()
	udpWG.Wait()

	// Results.
	var slowest time.Duration
	for _, d := range handovers {
		slowest = max(slowest, d)
	}
	t.Logf("MEASURE %d upgrades: hand-over (new started → old gone, new answering) %v … %v", len(handovers), minDur(handovers).Round(time.Millisecond), slowest.Round(time.Millisecond))
	asked, failed := newConns.asked.Load(), newConns.failed.Load()
	t.Logf("MEASURE new connections every 10ms: %d asked, %d failed; affinity client: %d asked, %d failed, backends %v; health checks failed: %d",
		asked, failed, aff.asked.Load(), aff.failed.Load(), aff.backends(), healthFails.Load())
	if failed > 0 {
		t.Errorf("%d of %d new connections failed (first: %v)", failed, asked, newConns.first.Load())
	}
	if asked < newConnsPerUpgrade*upgrades {
		t.Errorf("only %d new connections asked: the probe proves little", asked)
	}
	if aff.failed.Load() > 0 {
		t.Errorf("%d of %d connections of the affinity client failed (first: %v)", aff.failed.Load(), aff.asked.Load(), aff.first.Load())
	}
	if b := aff.backends(); len(b) != 1 {
		t.Errorf("the affinity client was answered by %v, want one backend throughout", b)
	}
	if healthFails.Load() > 0 {
		t.Errorf("the health server failed %d times during the upgrades (first %s)", healthFails.Load(), healthFails)
	}

	var lines, bytesUp, bytesDown, resets int64
	for _, s := range streams {
		err := s.finish()
		lines += s.recvd.Load()
		bytesUp += s.sentBytes.Load()
		bytesDown += s.recvdBytes.Load()
		if err != nil {
			if isReset(err) {
				resets++
			}
			t.Errorf("stream %s: %v", s.name, err)
		}
	}
	if got := transp.peer.Load(); got == nil || got.(netip.AddrPort).Addr() != outside.IP {
		t.Errorf("the transparent stream's backend saw the peer %v, want the outside client %v", got, outside.IP)
	}
	halfLines, err := half.finish(ctx, cli.NS, podByName)
	if err != nil {
		if isReset(err) {
			resets++
		}
		t.Errorf("the half-closed stream: %v", err)
	}
	t.Logf("MEASURE %d streams: %d lines checked, %d bytes sent and %d bytes echoed; half-closed stream: %d lines received after the client's EOF; resets: %d",
		len(streams), lines, bytesUp, bytesDown, halfLines, resets)
	t.Logf("MEASURE UDP flow on one socket: %d answered, %d unanswered, %d late, backends %v",
		udp.answered.Load(), udp.lost.Load(), udp.late.Load(), udp.backends())
	if udp.lost.Load() > 0 {
		t.Errorf("UDP flow: %d of %d datagrams unanswered", udp.lost.Load(), udp.sent.Load())
	}
	if b := udp.backends(); len(b) != 1 {
		t.Errorf("UDP flow answered by %v, want one backend throughout; %s", b, strings.Join(udp.changes, "; "))
	}

	if len(samples) == 2 {
		a, b := samples[0], samples[1]
		// The same binary, flags and traffic: a fresh process holds what it was handed. The
		// splice pipes are left out: the pools keep idle pipes up to a bound, as many as the
		// busiest instant needed.
		if b.fds > a.fds+1 {
			t.Errorf("descriptors (but pipes) grew from %d after upgrade 2 to %d after upgrade %d", a.fds, b.fds, upgrades)
		}
		if b.goroutines > a.goroutines+2 {
			t.Errorf("goroutines grew from %d after upgrade 2 to %d after upgrade %d", a.goroutines, b.goroutines, upgrades)
		}
	}
	if got := upgradeRules(t, node); got != rulesBefore {
		t.Errorf("the rules changed over %d upgrades:\nbefore:\n%s\nafter:\n%s", upgrades, rulesBefore, got)
	}
	checkNotDropped(t, "the last proxy", cur)
	if err := cur.Terminate(30 * time.Second); err != nil {
		t.Errorf("stopping the last proxy: %v", err)
	}
	t.Logf("MEASURE the whole test took %v", time.Since(begin).Round(time.Millisecond))
}

// buildProxyVersion builds kube-userspace-proxy from this module into dir, stamped with
// version, and returns its path.
func buildProxyVersion(dir, version string) (string, error) {
	gomod, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	out := filepath.Join(dir, "kube-userspace-proxy-"+version)
	cmd := exec.Command("go", "build", "-ldflags",
		"-X github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/app.Version="+version,
		"-o", out, "./cmd/kube-userspace-proxy")
	cmd.Dir = filepath.Dir(strings.TrimSpace(string(gomod)))
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build (version %s): %w: %s", version, err, b)
	}
	return out, nil
}

// startProxyBinary is harness.StartProxy running the binary bin.
func startProxyBinary(t *testing.T, ns *netns.NS, bin string, cfg harness.ProxyConfig, ready func(context.Context) error) *harness.Proxy {
	t.Helper()
	args := harness.ProxyArgs(t, cfg)
	args[0] = bin
	p := &harness.Proxy{Config: cfg, Args: args, Started: time.Now()}
	p.Process = ns.Start(t, args...)
	err := harness.Eventually(context.Background(), harness.DefaultReadyTimeout, func() error {
		select {
		case <-p.Done():
			return fmt.Errorf("exited (%v)", p.Err())
		default:
		}
		cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		return ready(cctx)
	})
	if err != nil {
		t.Fatalf("proxy %s not ready after %v: %v; log:\n%s", p.Process, time.Since(p.Started).Round(time.Millisecond), err, p.Tail(40))
	}
	p.Ready = time.Now()
	return p
}

var adoptedRE = regexp.MustCompile(`adopted what the predecessor handed over.*`)

// logField returns the integer field key=N of a console log line (-1 if missing).
func logField(line, key string) int {
	m := regexp.MustCompile(`\b` + key + `=(\d+)`).FindStringSubmatch(line)
	if m == nil {
		return -1
	}
	v, _ := strconv.Atoi(m[1])
	return v
}

// checkHandedOver checks that prev exited cleanly after handing over, and that cur, running
// bin, adopted the listeners, the long-lived connections, the UDP session and the affinity.
func checkHandedOver(t *testing.T, i int, prev, cur *harness.Proxy, bin string) {
	t.Helper()
	if err := prev.Err(); err != nil {
		t.Errorf("upgrade %d: the old proxy exited with %v, want 0; its log:\n%s", i, err, prev.Tail(30))
	}
	if !strings.Contains(prev.Log(), "handed over to the successor; exiting") {
		t.Errorf("upgrade %d: the old proxy's log does not say it handed over:\n%s", i, prev.Tail(30))
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", prev.Pid())); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("upgrade %d: the old proxy (pid %d) is still there: %v", i, prev.Pid(), err)
	}
	if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", cur.Pid())); err != nil || exe != bin {
		t.Errorf("upgrade %d: the new proxy runs %q (%v), want %s", i, exe, err, bin)
	}
	version := strings.TrimPrefix(filepath.Base(bin), "kube-userspace-proxy-")
	log := cur.Log()
	if !strings.Contains(log, "version="+version) {
		t.Errorf("upgrade %d: the new proxy does not log its version %s:\n%s", i, version, cur.Tail(30))
	}
	line := adoptedRE.FindString(log)
	if line == "" {
		t.Errorf("upgrade %d: the new proxy's log does not say what it adopted:\n%s", i, cur.Tail(30))
		return
	}
	// web tcp+udp, sticky, local; 20 streams, the half-closed and the transparent one.
	if logField(line, "listeners") < 4 || logField(line, "tcpConnections") < 22 || logField(line, "udpSessions") < 1 || logField(line, "affinityPorts") < 1 {
		t.Errorf("upgrade %d: the new proxy %s; want ≥ 4 listeners, ≥ 22 TCP connections, ≥ 1 UDP session, ≥ 1 affinity port", i, line)
	}
	checkNotDropped(t, fmt.Sprintf("upgrade %d: the old proxy", i), prev)
}

// droppedRE matches the log lines of a proxy that dropped something handed over.
var droppedRE = regexp.MustCompile(`.*(not adopted|not usable|hand-over failed).*`)

// checkNotDropped fails if p's log says something handed over was dropped.
func checkNotDropped(t *testing.T, what string, p *harness.Proxy) {
	t.Helper()
	if lines := droppedRE.FindAllString(p.Log(), -1); len(lines) > 0 {
		t.Errorf("%s dropped something handed over:\n%s", what, strings.Join(lines, "\n"))
	}
}

// upgradeRules returns what the proxy set up in the node: its iptables rules and chains (every
// line naming a KUBE- chain) and the transparent routing.
func upgradeRules(t *testing.T, node *netns.Node) string {
	t.Helper()
	var b strings.Builder
	for _, line := range strings.Split(harness.IPTablesSave(t, node.NS), "\n") {
		if strings.Contains(line, "KUBE-") {
			b.WriteString(line + "\n")
		}
	}
	rules, routes, _ := transparentState(t, node)
	return b.String() + rules + routes
}

// minOver returns the least of five samples taken 100 ms apart (-1 if every one failed).
func minOver(sample func() (int, error)) int {
	least := -1
	for range 5 {
		if v, err := sample(); err == nil && (least < 0 || v < least) {
			least = v
		}
		time.Sleep(100 * time.Millisecond)
	}
	return least
}

// countFDs returns how many descriptors process pid holds, pipes apart, and how many pipes.
func countFDs(pid int) (fds, pipes int, err error) {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, 0, err
	}
	for _, e := range ents {
		if target, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && strings.HasPrefix(target, "pipe:") {
			pipes++
		} else {
			fds++
		}
	}
	return fds, pipes, nil
}

// goroutines reads go_goroutines from the proxy's metrics server inside ns.
func goroutines(ns *netns.NS, addr string) (int, error) {
	m, err := harness.ScrapeMetrics(ns, addr)
	if err != nil {
		return 0, err
	}
	n, ok := m["go_goroutines"]
	if !ok {
		return 0, errors.New("no go_goroutines in the metrics")
	}
	return int(n), nil
}

func minDur(ds []time.Duration) time.Duration {
	least := ds[0]
	for _, d := range ds {
		least = min(least, d)
	}
	return least
}

func isReset(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// progress is how far the long-lived traffic had got.
type progress struct {
	streams []int64
	drip    int64
	udp     int64
}

func snapshotProgress(streams []*checkedStream, half *halfClosed, udp *udpFlow) progress {
	p := progress{drip: half.drips.Load(), udp: udp.answered.Load()}
	for _, s := range streams {
		p.streams = append(p.streams, s.recvd.Load())
	}
	return p
}

// waitProgress waits until every stream, the half-closed one and the UDP flow have moved on
// since before the upgrade: each was carried through it.
func waitProgress(t *testing.T, i int, before progress, streams []*checkedStream, half *halfClosed, udp *udpFlow) {
	t.Helper()
	err := harness.Eventually(context.Background(), 15*time.Second, func() error {
		now := snapshotProgress(streams, half, udp)
		for k, s := range streams {
			if now.streams[k] <= before.streams[k] {
				return fmt.Errorf("stream %s stalled at line %d", s.name, now.streams[k])
			}
		}
		if now.drip <= before.drip {
			return fmt.Errorf("the half-closed stream stalled at drip %d", now.drip)
		}
		if now.udp <= before.udp {
			return fmt.Errorf("the UDP flow stalled at %d answers", now.udp)
		}
		return nil
	})
	if err != nil {
		t.Errorf("upgrade %d: traffic did not go on: %v", i, err)
	}
}

// checkedStream is an established TCP connection to a kup-echo service carrying numbered lines
// of pseudo-random payload both ways without pause: every line must come back once, in order,
// from one backend that always sees the same peer; both sides keep a running hash of the
// payload. finish stops the writer, waits for the rest, half-closes and expects a clean EOF.
type checkedStream struct {
	name     string
	conn     *net.TCPConn
	wantPeer netip.Addr // the peer address the backend must see; invalid: any (but one)
	backend  string
	peer     atomic.Value // netip.AddrPort the backend saw
	stop     chan struct{}
	wrote    chan struct{} // closed when the writer is done
	done     chan error
	sentHash hash.Hash // the writer's
	recvHash hash.Hash // the reader's
	writeErr error     // set before wrote is closed

	closedWrite atomic.Bool // finish half-closed the stream

	sent, recvd, sentBytes, recvdBytes atomic.Int64
}

func startCheckedStream(ctx context.Context, t *testing.T, name string, ns *netns.NS, addr string, wantPeer netip.Addr) *checkedStream {
	t.Helper()
	conn, err := ns.DialContext(ctx, "tcp", addr)
	if err != nil {
		t.Fatalf("stream %s: %v", name, err)
	}
	t.Cleanup(func() { conn.Close() })
	s := &checkedStream{name: name, conn: conn.(*net.TCPConn), wantPeer: wantPeer, stop: make(chan struct{}),
		wrote: make(chan struct{}), done: make(chan error, 1), sentHash: sha256.New(), recvHash: sha256.New()}
	go s.write()
	go func() { s.done <- s.read(bufio.NewReader(conn)) }()
	return s
}

// letters are random letters the streams' payloads are cut from.
var letters = func() string {
	r := rand.New(rand.NewPCG(14, 14))
	b := make([]byte, 1<<16)
	for k := range b {
		b[k] = 'a' + byte(r.IntN(26))
	}
	return string(b)
}()

// streamPayload is line i of stream name: 20–1200 random letters, a pure function of both.
func streamPayload(name string, i int) string {
	h := uint64(i+1)*0x9e3779b97f4a7c15 ^ uint64(len(name))<<32 ^ uint64(name[len(name)-1])<<40 ^ uint64(name[0])<<48
	h ^= h >> 29
	size := 20 + int(h%1180)
	off := int(h>>16) % (len(letters) - size)
	return fmt.Sprintf("%s %08d %s\n", name, i, letters[off:off+size])
}

func (s *checkedStream) write() {
	defer close(s.wrote)
	for i := 0; ; i++ {
		select {
		case <-s.stop:
			return
		default:
		}
		line := streamPayload(s.name, i)
		_ = s.conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(s.conn, line); err != nil {
			s.writeErr = fmt.Errorf("write of line %d: %w", i, err)
			return
		}
		s.sentHash.Write([]byte(line))
		s.sentBytes.Add(int64(len(line)))
		s.sent.Add(1)
		time.Sleep(15 * time.Millisecond)
	}
}

// read checks the echoed lines until the backend's EOF, which must come after finish
// half-closed the stream and every line is back.
func (s *checkedStream) read(r *bufio.Reader) error {
	for i := int64(0); ; i++ {
		_ = s.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		line, err := r.ReadString('\n')
		if err != nil {
			if errors.Is(err, io.EOF) && line == "" && s.closedWrite.Load() && i == s.sent.Load() {
				return nil
			}
			return fmt.Errorf("after %d of %d lines: %w", i, s.sent.Load(), err)
		}
		f := strings.SplitN(line, " ", 3)
		if len(f) != 3 {
			return fmt.Errorf("answer %d malformed: %.60q", i, line)
		}
		peer, err := netip.ParseAddrPort(f[1])
		if err != nil {
			return fmt.Errorf("answer %d: peer %q: %w", i, f[1], err)
		}
		peer = netip.AddrPortFrom(peer.Addr().Unmap(), peer.Port())
		if s.backend == "" {
			s.backend = f[0]
			s.peer.Store(peer)
			if s.wantPeer.IsValid() && peer.Addr() != s.wantPeer {
				return fmt.Errorf("the backend sees the peer %v, want %v", peer, s.wantPeer)
			}
		}
		if want := streamPayload(s.name, int(i)); f[0] != s.backend || f[2] != want {
			return fmt.Errorf("line %d came back from %s as %.40q… (%d bytes), want %.40q… (%d bytes) from %s", i, f[0], f[2], len(f[2]), want, len(want), s.backend)
		}
		if got := s.peer.Load().(netip.AddrPort); got != peer {
			return fmt.Errorf("line %d: the backend saw the peer %v, %v before", i, peer, got)
		}
		s.recvHash.Write([]byte(f[2]))
		s.recvdBytes.Add(int64(len(f[2])))
		s.recvd.Add(1)
	}
}

// finish stops the writer, half-closes the stream, waits for every line and the backend's
// EOF (no reset), and compares the hashes.
func (s *checkedStream) finish() error {
	close(s.stop)
	<-s.wrote
	if s.writeErr != nil {
		return s.writeErr
	}
	s.closedWrite.Store(true)
	if err := s.conn.CloseWrite(); err != nil {
		return fmt.Errorf("half-close at the end: %w", err)
	}
	select {
	case err := <-s.done:
		if err != nil {
			return err
		}
	case <-time.After(30 * time.Second):
		return fmt.Errorf("lines sent: %d, back: %d; not all came back within 30s", s.sent.Load(), s.recvd.Load())
	}
	if s.sent.Load() < 100 {
		return fmt.Errorf("only %d lines sent: the stream proves little", s.sent.Load())
	}
	if sent, got := s.sentHash.Sum(nil), s.recvHash.Sum(nil); string(sent) != string(got) || s.sentBytes.Load() != s.recvdBytes.Load() {
		return fmt.Errorf("sent %d bytes (sha256 %x), got back %d (sha256 %x)", s.sentBytes.Load(), sent, s.recvdBytes.Load(), got)
	}
	return nil
}

// halfClosed is a stream the client half-closes at once after asking the backend to drip
// lines (kup-echo's "!drip"): through every upgrade, it only receives.
type halfClosed struct {
	conn    *net.TCPConn
	backend atomic.Value // string
	sawEOF  atomic.Bool  // the backend said it saw the client's EOF
	drips   atomic.Int64 // drip lines received, in order
	done    chan error
}

const halfLines = 50 // lines the half-closed stream sends before closing its side

func startHalfClosed(ctx context.Context, t *testing.T, ns *netns.NS, addr string) *halfClosed {
	t.Helper()
	conn, err := ns.DialContext(ctx, "tcp", addr)
	if err != nil {
		t.Fatalf("half-closed stream: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	h := &halfClosed{conn: conn.(*net.TCPConn), done: make(chan error, 1)}
	var b strings.Builder
	for i := range halfLines {
		b.WriteString(streamPayload("half", i))
	}
	b.WriteString("!drip half 20ms\n")
	if _, err := io.WriteString(conn, b.String()); err != nil {
		t.Fatal(err)
	}
	if err := h.conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	go func() { h.done <- h.read(bufio.NewReader(conn)) }()
	return h
}

// read checks: the echo of every line sent, then (interleaved with "eof") drip lines 0, 1, …,
// "dripped half N" with N the drips received, then EOF.
func (h *halfClosed) read(r *bufio.Reader) error {
	payload := func() (string, error) {
		_ = h.conn.SetReadDeadline(time.Now().Add(20 * time.Second))
		line, err := r.ReadString('\n')
		if err != nil {
			return "", fmt.Errorf("after %d drips: %w", h.drips.Load(), err)
		}
		f := strings.SplitN(line, " ", 3)
		if len(f) != 3 {
			return "", fmt.Errorf("malformed %.60q", line)
		}
		if b := h.backend.Load(); b == nil {
			h.backend.Store(f[0])
		} else if b != f[0] {
			return "", fmt.Errorf("line from %s, before from %s", f[0], b)
		}
		return f[2], nil
	}
	for i := range halfLines {
		p, err := payload()
		if err != nil {
			return err
		}
		if want := streamPayload("half", i); p != want {
			return fmt.Errorf("echo %d is %.40q, want %.40q", i, p, want)
		}
	}
	p, err := payload()
	if err != nil {
		return err
	}
	if p != "!drip half 20ms\n" {
		return fmt.Errorf("got %.40q, want the echo of the drip request", p)
	}
	for {
		p, err := payload()
		if err != nil {
			return err
		}
		seq := h.drips.Load()
		switch {
		case p == "eof\n" && !h.sawEOF.Load():
			h.sawEOF.Store(true)
		case strings.HasPrefix(p, fmt.Sprintf("drip half %d ", seq)):
			if want := fmt.Sprintf("drip half %d %s\n", seq, strings.Repeat("x", int(seq)*53%500)); p != want {
				return fmt.Errorf("drip %d is %.40q, want %.40q", seq, p, want)
			}
			h.drips.Add(1)
		case p == fmt.Sprintf("dripped half %d\n", seq):
			if !h.sawEOF.Load() {
				return errors.New("the backend never saw the client's EOF")
			}
			_ = h.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			if rest, err := io.ReadAll(r); err != nil || len(rest) > 0 {
				return fmt.Errorf("after the last drip: %q, %v; want EOF", rest, err)
			}
			return nil
		default:
			return fmt.Errorf("after %d drips: got %.40q", seq, p)
		}
	}
}

// finish tells the backend, on a direct connection from ns, to stop dripping, and waits for
// the rest and the backend's EOF. It returns the drip lines received.
func (h *halfClosed) finish(ctx context.Context, ns *netns.NS, pods map[string]*netns.Pod) (int64, error) {
	select {
	case err := <-h.done:
		return h.drips.Load(), fmt.Errorf("ended early: %v", err)
	default:
	}
	name, _ := h.backend.Load().(string)
	pod := pods[name]
	if pod == nil {
		return 0, fmt.Errorf("unknown backend %q", name)
	}
	conn, err := ns.DialContext(ctx, "tcp", netip.AddrPortFrom(pod.IP, echoPort).String())
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(conn, "!stop half\n"); err != nil {
		return 0, err
	}
	if _, err := bufio.NewReader(conn).ReadString('\n'); err != nil {
		return 0, fmt.Errorf("stop: %w", err)
	}
	select {
	case err := <-h.done:
		if err == nil && h.drips.Load() < 100 {
			err = fmt.Errorf("only %d drips: the stream proves little", h.drips.Load())
		}
		return h.drips.Load(), err
	case <-time.After(30 * time.Second):
		return h.drips.Load(), errors.New("no end within 30s of the stop")
	}
}

// udpFlow is one kept UDP socket asking a kup-echo service a numbered datagram at a time.
type udpFlow struct {
	pc   net.PacketConn
	addr *net.UDPAddr

	mu      sync.Mutex
	seen    map[string]int // answers per backend
	last    string         // the backend of the last answer
	changes []string       // when the backend changed

	sent, answered, lost, late atomic.Int64
}

func startUDPFlow(t *testing.T, ns *netns.NS, addr string) *udpFlow {
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
	return &udpFlow{pc: pc, addr: ua, seen: map[string]int{}}
}

// run sends datagram after datagram (each waits up to 2s for its answer) until ctx ends.
func (u *udpFlow) run(ctx context.Context) {
	buf := make([]byte, 2048)
	for seq := 0; ctx.Err() == nil; seq++ {
		payload := fmt.Sprintf("u %d", seq)
		if _, err := u.pc.WriteTo([]byte(payload), u.addr); err != nil {
			u.lost.Add(1)
			time.Sleep(20 * time.Millisecond)
			continue
		}
		u.sent.Add(1)
		deadline := time.Now().Add(2 * time.Second)
		for {
			_ = u.pc.SetReadDeadline(deadline)
			n, _, err := u.pc.ReadFrom(buf)
			if err != nil {
				u.lost.Add(1)
				break
			}
			f := strings.SplitN(string(buf[:n]), " ", 3)
			if len(f) != 3 || f[2] != payload {
				u.late.Add(1) // an answer to an earlier datagram
				continue
			}
			u.mu.Lock()
			if u.last != "" && u.last != f[0] {
				u.changes = append(u.changes, fmt.Sprintf("datagram %d: %s → %s during upgrade %d", seq, u.last, f[0], currentUpgrade.Load()))
			}
			u.last = f[0]
			u.seen[f[0]]++
			u.mu.Unlock()
			u.answered.Add(1)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (u *udpFlow) backends() map[string]int {
	u.mu.Lock()
	defer u.mu.Unlock()
	out := map[string]int{}
	for k, v := range u.seen {
		out[k] = v
	}
	return out
}

// connProbe counts new connections and their failures.
type connProbe struct {
	asked, failed atomic.Int64
	first         atomic.Value // the first failure's message
	paused        atomic.Bool  // no new connection while set
	inflight      atomic.Int64

	mu   sync.Mutex
	seen map[string]int
}

// pause stops (or resumes) the probe; stopping waits (up to 5s) until none of its connections
// is open.
func (p *connProbe) pause(on bool) {
	p.paused.Store(on)
	for deadline := time.Now().Add(5 * time.Second); on && p.inflight.Load() > 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if on {
		time.Sleep(100 * time.Millisecond) // the proxy's side closes last
	}
}

func (p *connProbe) ask(ctx context.Context, ns *netns.NS, addr string) {
	p.inflight.Add(1)
	defer p.inflight.Add(-1)
	if p.paused.Load() {
		return
	}
	a, err := harness.AskTimeout(ctx, ns, "tcp", addr, 5*time.Second)
	if ctx.Err() != nil {
		return
	}
	p.asked.Add(1)
	if err != nil {
		p.failed.Add(1)
		p.first.CompareAndSwap(nil, err.Error())
		return
	}
	p.mu.Lock()
	p.seen[a.Backend]++
	p.mu.Unlock()
}

func (p *connProbe) backends() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[string]int{}
	for k, v := range p.seen {
		out[k] = v
	}
	return out
}

// probeNewConnections opens a new connection every interval (each on its own goroutine, at
// most 200 at once, so a connection waiting in a backlog during a hand-over does not delay the
// next) until ctx ends.
func probeNewConnections(ctx context.Context, wg *sync.WaitGroup, ns *netns.NS, addr string, interval time.Duration) *connProbe {
	p := &connProbe{seen: map[string]int{}}
	sem := make(chan struct{}, 200)
	wg.Go(func() {
		tick := time.NewTicker(interval)
		defer tick.Stop()
		var inflight sync.WaitGroup
		defer inflight.Wait()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				return
			}
			inflight.Go(func() {
				defer func() { <-sem }()
				p.ask(context.WithoutCancel(ctx), ns, addr)
			})
		}
	})
	return p
}

// probeAffinity opens a new connection every interval, one at a time, until ctx ends.
func probeAffinity(ctx context.Context, wg *sync.WaitGroup, ns *netns.NS, addr string, interval time.Duration) *connProbe {
	p := &connProbe{seen: map[string]int{}}
	wg.Go(func() {
		for ctx.Err() == nil {
			p.ask(ctx, ns, addr)
			time.Sleep(interval)
		}
	})
	return p
}
