//go:build linux

package e2e

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// The hostile fixture's proxy: a lowered open-files limit, and its health and metrics servers on
// the node's address, where anyone on the node's network reaches them.
const (
	hostileFileLimit = 1024
	hostileHealthz   = 10256
	hostileMetrics   = 10249
	// hostileUDPTimeout ends the canaries' UDP sessions soon, so that the descriptor count
	// returns to its baseline between cases.
	hostileUDPTimeout = time.Second
	// fdSlack is how far from its baseline the proxy's descriptor count may settle after an
	// attack: the API watch and the runtime may hold a few more or fewer.
	fdSlack = 6
	// idlePipesMax is how many idle splice pipes the proxy keeps (proxy/forward/tcp's pipePoolMax).
	idlePipesMax = 32
	// Flood sizes.
	healthFloodConns = 3000
	udpFloodSources  = 2000
	udpFloodBasePort = 20000
)

// Addresses the outside client uses beyond the netns plan.
var (
	// outsideRange is a loadBalancerSourceRanges entry that does not hold the outside client.
	outsideRange = netip.MustParsePrefix("192.0.2.0/24")
	// futureClusterIP is the ClusterIP of a service created after the endpoint naming it.
	futureClusterIP = netip.MustParseAddr("10.96.200.200")
)

// hostile is one control plane, one node whose proxy runs with an open-files limit of
// hostileFileLimit, two backend pods (p1 serves the canaries, p2 everything else), a client pod
// and an outside client.
type hostile struct {
	n         *netns.Network
	c         *cluster.Cluster
	node      *netns.Node
	p1, p2    *netns.Pod
	clientPod *netns.Pod
	client    *netns.Host
	proxy     *harness.Proxy
	pid       int
	canary    *corev1.Service // TCP port 0 (80) and UDP port 1 (53) on p1
	// maxConns and maxSessions are the per-port bounds the proxy logged.
	maxConns, maxSessions int
	// The proxy's state with only the canaries: descriptors (all, pipes, the others) and rules.
	baseFDs, basePipes, baseOther int
	baseRules                     []string
	hc                            *http.Client // from the outside client, no keep-alive
}

// healthURL and metricsURL are the proxy's servers on the node's address.
func (h *hostile) healthURL() string {
	return fmt.Sprintf("http://%s/healthz", netip.AddrPortFrom(h.node.IP, hostileHealthz))
}

func (h *hostile) metricsURL() string {
	return fmt.Sprintf("http://%s/metrics", netip.AddrPortFrom(h.node.IP, hostileMetrics))
}

func newHostile(t *testing.T) *hostile {
	t.Helper()
	for _, tool := range []string{"prlimit", "setpriv"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s (util-linux) is needed to lower the proxy's open-files limit: %v", tool, err)
		}
	}
	h := &hostile{n: netns.NewNetwork(t, "hos")}
	h.c = cluster.Start(t, cluster.Options{Network: h.n})
	h.node = h.n.AddNode(t, "hn")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := h.c.CreateNode(ctx, nodeName, h.node.IP); err != nil {
		t.Fatal(err)
	}
	h.p1 = h.n.AddPod(t, h.node, "p1")
	h.p2 = h.n.AddPod(t, h.node, "p2")
	harness.StartEcho(t, h.p1.NS, "p1", echoPort)
	harness.StartEcho(t, h.p2.NS, "p2", echoPort)
	h.clientPod = h.n.AddPod(t, h.node, "cli")
	h.client = h.n.AddClient(t, "out")
	for _, dst := range []string{cluster.ServiceCIDR, lbIP.String() + "/32", excludedAddr.String() + "/32"} {
		h.client.Run(t, "ip", "route", "add", dst, "via", h.node.IP.String())
	}
	for _, key := range []string{"net.ipv4.conf.all.send_redirects", "net.ipv4.conf.eth0.send_redirects"} {
		if err := h.node.SetSysctl(key, "0"); err != nil {
			t.Fatal(err)
		}
	}
	// A second node address, which --nodeport-addresses leaves out.
	h.node.Run(t, "ip", "addr", "add", excludedAddr.String()+"/32", "dev", "lo")
	h.hc = &http.Client{
		Transport: &http.Transport{DialContext: h.client.DialContext, DisableKeepAlives: true},
		Timeout:   5 * time.Second,
	}
	t.Cleanup(h.hc.CloseIdleConnections)

	h.canary = harness.CreateService(ctx, t, h.c.Client, harness.ClusterIPService("canary",
		harness.TCPPort("tcp", 80, echoPort), harness.UDPPort("udp", 53, echoPort)))
	harness.ApplySlice(ctx, t, h.c.Client, harness.Slice(h.canary, harness.Endpoint{IP: h.p1.IP, Node: nodeName, Name: "p1"}))

	// prlimit lowers both limits; setpriv takes CAP_SYS_RESOURCE away, without which the proxy
	// cannot raise the hard limit again (RaiseFileLimit tries, as root may).
	h.proxy = harness.StartProxy(t, h.node.NS, harness.ProxyConfig{
		NodeName:           nodeName,
		Kubeconfig:         h.c.Kubeconfig,
		HealthzBindAddress: netip.AddrPortFrom(h.node.IP, hostileHealthz).String(),
		MetricsBindAddress: netip.AddrPortFrom(h.node.IP, hostileMetrics).String(),
		LogLevel:           "info",
		Wrapper: []string{"prlimit", fmt.Sprintf("--nofile=%d:%d", hostileFileLimit, hostileFileLimit), "--",
			"setpriv", "--bounding-set=-sys_resource", "--"},
		Args: []string{
			"--iptables-sync-period=" + syncPeriod.String(),
			"--iptables-min-sync-period=100ms",
			"--nodeport-addresses=" + netip.PrefixFrom(h.node.IP, 32).String(),
			"--udp-timeout=" + hostileUDPTimeout.String(),
		},
		Ready: func(ctx context.Context) error {
			_, err := harness.AskTimeout(ctx, h.clientPod.NS, "tcp", harness.Addr(h.canary, 0), time.Second)
			return err
		},
	})
	h.pid = h.proxy.Pid()
	h.checkLimits(t)
	return h
}

// checkLimits fails the test unless the proxy process runs with the lowered limit and says so.
func (h *hostile) checkLimits(t *testing.T) {
	t.Helper()
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", h.pid))
	if err != nil || !strings.HasSuffix(exe, "/kube-userspace-proxy") {
		t.Fatalf("pid %d is %q (%v), not the proxy: the wrappers did not exec it", h.pid, exe, err)
	}
	limits, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", h.pid))
	if err != nil {
		t.Fatal(err)
	}
	want := regexp.MustCompile(fmt.Sprintf(`(?m)^Max open files\s+%d\s+%d\s`, hostileFileLimit, hostileFileLimit))
	if !want.Match(limits) {
		t.Fatalf("the proxy's open-files limit is not %d (it raised it?):\n%s", hostileFileLimit, limits)
	}
	log := h.proxy.Log()
	field := func(name string) int {
		m := regexp.MustCompile(name + `=(\d+)`).FindStringSubmatch(log)
		if m == nil {
			t.Fatalf("no %s in the proxy's log:\n%s", name, h.proxy.Tail(20))
		}
		v, _ := strconv.Atoi(m[1])
		return v
	}
	if got := field("openFilesLimit"); got != hostileFileLimit {
		t.Fatalf("the proxy logged openFilesLimit=%d, want %d", got, hostileFileLimit)
	}
	h.maxConns, h.maxSessions = field("maxConnectionsPerPort"), field("maxUDPSessionsPerPort")
	t.Logf("MEASURE proxy budget: open files %d, reserve %d, %d connections / %d UDP sessions per port",
		hostileFileLimit, field("reserve"), h.maxConns, h.maxSessions)
}

// fds returns how many descriptors the proxy has open.
func (h *hostile) fds(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", h.pid))
	if err != nil {
		t.Fatalf("descriptors of the proxy (pid %d): %v", h.pid, err)
	}
	return len(ents)
}

// fdSampler records the largest descriptor count of the proxy until stopped.
type fdSampler struct {
	max  atomic.Int64
	stop chan struct{}
	done chan struct{}
}

func (h *hostile) sampleFDs() *fdSampler {
	s := &fdSampler{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		for {
			if ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", h.pid)); err == nil && int64(len(ents)) > s.max.Load() {
				s.max.Store(int64(len(ents)))
			}
			select {
			case <-s.stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	return s
}

// Max stops the sampler and returns the largest count seen.
func (s *fdSampler) Max() int {
	select {
	case <-s.stop:
	default:
		close(s.stop)
	}
	<-s.done
	return int(s.max.Load())
}

// rules returns the node's rules (the -A lines of iptables-save, all tables), sorted.
func (h *hostile) rules(t testing.TB) []string {
	t.Helper()
	var out []string
	for _, l := range strings.Split(harness.IPTablesSave(t, h.node.NS), "\n") {
		if strings.HasPrefix(l, "-A ") {
			out = append(out, l)
		}
	}
	slices.Sort(out)
	return out
}

// healthz GETs /healthz from the outside client and returns an error unless it answers 200.
func (h *hostile) healthz(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.healthURL(), nil)
	if err != nil {
		return err
	}
	resp, err := h.hc.Do(req)
	if err != nil {
		return fmt.Errorf("/healthz: %w", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("/healthz: %s: %s", resp.Status, body)
	}
	return nil
}

// metrics returns /metrics, scraped from the node.
func (h *hostile) metrics(t testing.TB) string {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DialContext: h.node.DialContext, DisableKeepAlives: true}, Timeout: 5 * time.Second}
	defer hc.CloseIdleConnections()
	resp, err := hc.Get(h.metricsURL())
	if err != nil {
		t.Fatalf("scrape %s: %v", h.metricsURL(), err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %s, %v", h.metricsURL(), resp.Status, err)
	}
	return string(b)
}

// metricSum sums the samples of metric whose labels include service="svc".
func metricSum(text, metric, svc string) (float64, bool) {
	var sum float64
	found := false
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, metric+"{") || !strings.Contains(line, `service="`+svc+`"`) {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err == nil {
			sum += v
			found = true
		}
	}
	return sum, found
}

// served checks, as errors of t, that the canaries answer from the pod and from the outside
// client (TCP and UDP, each from p1) and that /healthz answers 200.
func (h *hostile) served(ctx context.Context, t *testing.T, when string) {
	t.Helper()
	for _, fr := range []from{{"pod", h.clientPod.NS}, {"outside", h.client.NS}} {
		for i, network := range []string{"tcp", "udp"} {
			a, err := harness.AskTimeout(ctx, fr.ns, network, harness.Addr(h.canary, i), 3*time.Second)
			switch {
			case err != nil:
				t.Errorf("%s: %s canary from %s not served: %v", when, network, fr.name, err)
			case a.Backend != "p1":
				t.Errorf("%s: %s canary from %s answered by %s, want p1", when, network, fr.name, a.Backend)
			}
		}
	}
	if err := h.healthz(ctx); err != nil {
		t.Errorf("%s: %v", when, err)
	}
}

// settle waits until the proxy's descriptors are back near the baseline and its rules are the
// baseline's again, then logs the count; it fails the test when they do not come back.
//
// Pipes are bounded rather than compared: the proxy keeps up to idlePipesMax idle splice pipes
// (two descriptors each) for later connections, as many as were busy at once, taken from the
// budget. Every other descriptor must come back to within fdSlack of the baseline. The canaries'
// UDP sessions of the last checks live for hostileUDPTimeout: the figure logged is taken once
// they have ended (or after a bound), the check does not wait for it.
func (h *hostile) settle(t *testing.T, what string) {
	t.Helper()
	var kinds map[string]int
	var rules []string
	err := harness.Eventually(context.Background(), converge, func() error {
		kinds, rules = h.fdKinds(), h.rules(t)
		other := total(kinds) - kinds["pipe"]
		if d := other - h.baseOther; d > fdSlack || d < -fdSlack {
			return fmt.Errorf("%d descriptors other than pipes open, baseline %d", other, h.baseOther)
		}
		if kinds["pipe"] > h.basePipes+2*idlePipesMax {
			return fmt.Errorf("%d pipe descriptors open, baseline %d, at most %d idle pipes are kept", kinds["pipe"], h.basePipes, idlePipesMax)
		}
		if !slices.Equal(rules, h.baseRules) {
			return fmt.Errorf("%d rules, baseline %d", len(rules), len(h.baseRules))
		}
		return nil
	})
	if err != nil {
		added, removed := diffLines(h.baseRules, rules)
		t.Errorf("%s: the proxy did not return to its baseline within %v: %v\nits descriptors: %v (baseline %d)\nrules added:\n%s\nrules removed:\n%s",
			what, converge, err, kinds, h.baseFDs, strings.Join(added, "\n"), strings.Join(removed, "\n"))
	} else {
		_ = harness.Eventually(context.Background(), 3*hostileUDPTimeout, func() error {
			if kinds = h.fdKinds(); total(kinds)-kinds["pipe"] > h.baseOther {
				return errors.New("canary sessions still open")
			}
			return nil
		})
	}
	t.Logf("MEASURE %s: descriptors after %d (baseline %d; pipes %d, baseline %d), rules %d (baseline %d)",
		what, total(kinds), h.baseFDs, kinds["pipe"], h.basePipes, len(rules), len(h.baseRules))
}

// total sums the counts of kinds.
func total(kinds map[string]int) int {
	n := 0
	for _, c := range kinds {
		n += c
	}
	return n
}

// fdKinds counts the proxy's descriptors by what they are (socket, pipe, anon_inode:[eventpoll],
// a path).
func (h *hostile) fdKinds() map[string]int {
	dir := fmt.Sprintf("/proc/%d/fd", h.pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return map[string]int{err.Error(): 0}
	}
	kinds := map[string]int{}
	for _, e := range ents {
		target, err := os.Readlink(dir + "/" + e.Name())
		if err != nil {
			continue
		}
		if i := strings.Index(target, ":["); i > 0 && !strings.HasPrefix(target, "anon_inode") {
			target = target[:i]
		}
		kinds[target]++
	}
	return kinds
}

// diffLines returns the lines of b not in a, and those of a not in b.
func diffLines(a, b []string) (added, removed []string) {
	for _, l := range b {
		if !slices.Contains(a, l) {
			added = append(added, l)
		}
	}
	for _, l := range a {
		if !slices.Contains(b, l) {
			removed = append(removed, l)
		}
	}
	return added, removed
}

// serve creates svc with a slice of backend p2 and registers its deletion in t's cleanup.
func (h *hostile) serve(ctx context.Context, t *testing.T, svc *corev1.Service) *corev1.Service {
	t.Helper()
	created := harness.CreateService(ctx, t, h.c.Client, svc)
	t.Cleanup(func() { harness.DeleteService(context.Background(), t, h.c.Client, created.Namespace, created.Name) })
	harness.ApplySlice(ctx, t, h.c.Client, harness.Slice(created, harness.Endpoint{IP: h.p2.IP, Node: nodeName, Name: "p2"}))
	return created
}

// proxyPort returns the proxy port that the rules of service name redirect proto ("tcp", "udp")
// traffic to.
func proxyPort(t *testing.T, listing, name, proto string) int {
	t.Helper()
	var lines []string
	for _, r := range harness.RulesFor(listing, harness.Namespace, name) {
		if strings.Contains(r, "-p "+proto+" ") && (strings.Contains(r, "-j REDIRECT") || strings.Contains(r, "-j DNAT")) {
			lines = append(lines, r)
		}
	}
	ports := redirectPorts(lines)
	if len(ports) != 1 {
		t.Fatalf("want one %s proxy port of %s in its rules, found %v:\n%s", proto, name, ports, strings.Join(lines, "\n"))
	}
	return ports[0]
}

// TestHostile attacks a proxy with a lowered open-files limit from the node's network and from
// bad API objects, and checks after each attack that other services are still served, /healthz
// answers, and the proxy's descriptors and rules come back to where they were.
func TestHostile(t *testing.T) {
	start := time.Now()
	h := newHostile(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// Wait for the canary's UDP path, then let its sessions expire for the baseline.
	waitAnswer(t, h.client.NS, "udp", harness.Addr(h.canary, 1))
	h.served(ctx, t, "before the attacks")
	time.Sleep(hostileUDPTimeout + time.Second)
	kinds := h.fdKinds()
	h.baseFDs, h.basePipes, h.baseRules = total(kinds), kinds["pipe"], h.rules(t)
	h.baseOther = h.baseFDs - h.basePipes
	t.Logf("fixture ready in %v; MEASURE baseline: %d descriptors %v, %d rules", time.Since(start).Round(time.Millisecond), h.baseFDs, kinds, len(h.baseRules))
	defer func() { t.Logf("MEASURE TestHostile took %v", time.Since(start).Round(time.Millisecond)) }()

	t.Run("health port idle flood", func(t *testing.T) { hostileHealthFlood(ctx, t, h) })
	t.Run("UDP source flood", func(t *testing.T) { hostileUDPFlood(ctx, t, h) })
	t.Run("self-loop endpoints", func(t *testing.T) { hostileSelfLoop(ctx, t, h) })
	t.Run("direct proxy port access", func(t *testing.T) { hostileProxyPort(ctx, t, h) })
	t.Run("loadBalancerSourceRanges", func(t *testing.T) { hostileSourceRanges(ctx, t, h) })
	t.Run("excluded NodePort address", func(t *testing.T) { hostileExcludedNodePort(ctx, t, h) })

	if t.Failed() {
		return
	}
	select {
	case <-h.proxy.Done():
		t.Fatalf("the proxy exited: %v", h.proxy.Err())
	default:
	}
}

// hostileHealthFlood opens healthFloodConns idle connections to the health port from the
// outside client and keeps them open while it checks the health server and the canaries.
func hostileHealthFlood(ctx context.Context, t *testing.T, h *hostile) {
	before := h.fds(t)
	addr := netip.AddrPortFrom(h.node.IP, hostileHealthz).String()
	sampler := h.sampleFDs()
	var mu sync.Mutex
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	var failed int
	var firstErr error
	begin := time.Now()
	floodCtx, floodCancel := context.WithTimeout(ctx, 60*time.Second)
	defer floodCancel()
	const workers = 4
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			// One thread in the client's namespace per worker: every socket it creates is the
			// client's.
			_ = h.client.Do(func() error {
				d := net.Dialer{Timeout: 3 * time.Second}
				for i := w; i < healthFloodConns; i += workers {
					c, err := d.DialContext(floodCtx, "tcp", addr)
					mu.Lock()
					if err != nil {
						failed++
						if firstErr == nil {
							firstErr = err
						}
					} else {
						conns = append(conns, c)
					}
					mu.Unlock()
				}
				return nil
			})
		})
	}
	wg.Wait()
	took := time.Since(begin)
	during := h.fds(t)
	t.Logf("MEASURE health flood: %d connections established, %d failed (first: %v) in %v",
		len(conns), failed, firstErr, took.Round(time.Millisecond))
	if len(conns) < healthFloodConns/2 {
		t.Errorf("only %d of %d flood connections were established: the flood proves little", len(conns), healthFloodConns)
	}
	// While every flood connection is still open on the client's side.
	for i := range 3 {
		if err := h.healthz(ctx); err != nil {
			t.Errorf("during the flood, probe %d: %v", i, err)
		}
	}
	h.served(ctx, t, "during the health flood")
	closed := closedByPeer(conns)
	peak := sampler.Max()
	t.Logf("MEASURE health flood: proxy descriptors before %d, right after the flood %d, peak %d; %d of %d flood connections closed by the proxy",
		before, during, peak, closed, len(conns))
	// The health server holds at most its connection cap, whatever the flood.
	if limit := before + 128 + 2*fdSlack; peak > limit {
		t.Errorf("the proxy's descriptors peaked at %d during the health flood, more than %d (baseline %d + the health server's cap 128 + slack)", peak, limit, before)
	}
	for _, c := range conns {
		c.Close()
	}
	conns = nil
	h.served(ctx, t, "after the health flood")
	h.settle(t, "health flood")
}

// closedByPeer counts the connections whose peer has closed them (a read would return EOF or a
// reset), without blocking.
func closedByPeer(conns []net.Conn) int {
	n := 0
	buf := make([]byte, 1)
	for _, c := range conns {
		sc, ok := c.(syscall.Conn)
		if !ok {
			continue
		}
		raw, err := sc.SyscallConn()
		if err != nil {
			continue
		}
		var closed bool
		_ = raw.Read(func(fd uintptr) bool {
			m, _, err := unix.Recvfrom(int(fd), buf, unix.MSG_PEEK|unix.MSG_DONTWAIT)
			closed = (m == 0 && err == nil) || errors.Is(err, unix.ECONNRESET)
			return true
		})
		if closed {
			n++
		}
	}
	return n
}

// hostileUDPFlood sends one datagram from each of udpFloodSources source ports of the outside
// client to one UDP service.
func hostileUDPFlood(ctx context.Context, t *testing.T, h *hostile) {
	svc := h.serve(ctx, t, harness.ClusterIPService("flood", harness.UDPPort("udp", 53, echoPort)))
	dst := netip.MustParseAddrPort(harness.Addr(svc, 0))
	waitAnswer(t, h.client.NS, "udp", dst.String())
	m0 := h.metrics(t)
	opened0, _ := metricSum(m0, "kube_userspace_proxy_udp_sessions_opened_total", "flood")
	evicted0, _ := metricSum(m0, "kube_userspace_proxy_udp_sessions_evicted_total", "flood")
	before := h.fds(t)
	sampler := h.sampleFDs()

	var socks []*net.UDPConn
	defer func() {
		for _, s := range socks {
			s.Close()
		}
	}()
	var sendErrs int
	var firstErr error
	begin := time.Now()
	err := h.client.Do(func() error {
		for i := range udpFloodSources {
			src := netip.AddrPortFrom(h.client.IP, uint16(udpFloodBasePort+i))
			s, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(src))
			if err != nil {
				return fmt.Errorf("bind %s: %w", src, err)
			}
			socks = append(socks, s)
			if _, err := s.WriteToUDPAddrPort([]byte("flood\n"), dst); err != nil {
				sendErrs++
				if firstErr == nil {
					firstErr = err
				}
			}
			if i%100 == 99 {
				time.Sleep(2 * time.Millisecond) // let the proxy's socket buffer drain a little
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("MEASURE UDP flood: %d datagrams from distinct source ports sent in %v, %d send errors (first: %v)",
		udpFloodSources, time.Since(begin).Round(time.Millisecond), sendErrs, firstErr)
	// Let the proxy work through its receive queue: until the sessions opened stop growing.
	var m string
	var opened float64
	harness.Eventually(ctx, 10*time.Second, func() error {
		prev := opened
		m = h.metrics(t)
		opened, _ = metricSum(m, "kube_userspace_proxy_udp_sessions_opened_total", "flood")
		if opened == prev {
			return nil
		}
		time.Sleep(200 * time.Millisecond)
		return errors.New("still opening sessions")
	})
	during, peak := h.fds(t), sampler.Max()
	evicted, _ := metricSum(m, "kube_userspace_proxy_udp_sessions_evicted_total", "flood")
	active, haveActive := metricSum(m, "kube_userspace_proxy_udp_sessions_active", "flood")
	dropped, _ := metricSum(m, "kube_userspace_proxy_udp_datagrams_dropped_total", "flood")
	t.Logf("MEASURE UDP flood: sessions opened %.0f, evicted %.0f, active %.0f (bound %d), datagrams dropped %.0f; proxy descriptors before %d, after the flood %d, peak %d",
		opened-opened0, evicted-evicted0, active, h.maxSessions, dropped, before, during, peak)
	if evicted-evicted0 <= 0 {
		t.Errorf("%s after %d sources: no session evicted (bound %d per port)", "kube_userspace_proxy_udp_sessions_evicted_total", udpFloodSources, h.maxSessions)
	}
	if !haveActive || active > float64(h.maxSessions) {
		t.Errorf("flooded service: %.0f active sessions (metric present: %v), bound %d", active, haveActive, h.maxSessions)
	}
	if limit := before + h.maxSessions + 2*fdSlack; peak > limit {
		t.Errorf("the proxy's descriptors peaked at %d during the UDP flood, more than %d (before %d + the per-port session bound %d + slack)", peak, limit, before, h.maxSessions)
	}
	// A UDP service besides the canary, created before the flood ended, is served too.
	other := h.serve(ctx, t, harness.ClusterIPService("flood-other", harness.UDPPort("udp", 53, echoPort)))
	waitAnswer(t, h.clientPod.NS, "udp", harness.Addr(other, 0))
	h.served(ctx, t, "during the UDP flood")
	// A new client of the flooded service takes the longest-idle session's place.
	if a, err := harness.AskTimeout(ctx, h.clientPod.NS, "udp", dst.String(), 3*time.Second); err != nil {
		t.Errorf("a new client of the flooded service: %v", err)
	} else if a.Backend != "p2" {
		t.Errorf("a new client of the flooded service answered by %s, want p2", a.Backend)
	}
	for _, s := range socks {
		s.Close()
	}
	socks = nil
	harness.DeleteService(ctx, t, h.c.Client, svc.Namespace, svc.Name)
	harness.DeleteService(ctx, t, h.c.Client, other.Namespace, other.Name)
	h.served(ctx, t, "after the UDP flood")
	h.settle(t, "UDP flood")
}

// selfSlice is a second EndpointSlice of svc (port 0) naming ip:port.
func selfSlice(svc *corev1.Service, suffix string, ip netip.Addr, port int32) *discoveryv1.EndpointSlice {
	s := harness.Slice(svc, harness.Endpoint{IP: ip})
	s.Name = svc.Name + "-" + suffix
	s.Ports[0].Port = &port
	return s
}

// hostileSelfLoop gives services endpoints that are the proxy itself: another service's
// ClusterIP:port, the service's own ClusterIP:port, the node's address with a NodePort, and a
// ClusterIP:port taken only after the endpoint named it. Those services also have p2 as an
// endpoint: every connection must be answered by p2 (a self endpoint would be answered by p1, the
// other service's backend, after a detour through the proxy). A last service has only its own
// ClusterIP:port: a connection to it must not be answered, and must not make the proxy connect
// to itself until its descriptors run out.
func hostileSelfLoop(ctx context.Context, t *testing.T, h *hostile) {
	target := h.serve(ctx, t, harness.NodePortService("np-target", harness.TCPPort("tcp", 80, echoPort)))
	harness.ApplySlice(ctx, t, h.c.Client, harness.Slice(target, harness.Endpoint{IP: h.p1.IP, Node: nodeName, Name: "p1"}))
	waitAnswer(t, h.client.NS, "tcp", harness.NodePortAddr(h.node.IP, target, 0))

	loopCIP := h.serve(ctx, t, harness.ClusterIPService("loop-cip", harness.TCPPort("tcp", 7000, echoPort)))
	harness.ApplySlice(ctx, t, h.c.Client, selfSlice(loopCIP, "other", netip.MustParseAddr(h.canary.Spec.ClusterIP), h.canary.Spec.Ports[0].Port))
	harness.ApplySlice(ctx, t, h.c.Client, selfSlice(loopCIP, "own", netip.MustParseAddr(loopCIP.Spec.ClusterIP), loopCIP.Spec.Ports[0].Port))
	loopNP := h.serve(ctx, t, harness.ClusterIPService("loop-np", harness.TCPPort("tcp", 7001, echoPort)))
	harness.ApplySlice(ctx, t, h.c.Client, selfSlice(loopNP, "node", h.node.IP, target.Spec.Ports[0].NodePort))
	// The endpoint first, then the service that takes its address.
	loopLate := h.serve(ctx, t, harness.ClusterIPService("loop-late", harness.TCPPort("tcp", 7002, echoPort)))
	harness.ApplySlice(ctx, t, h.c.Client, selfSlice(loopLate, "future", futureClusterIP, 80))
	waitAnswer(t, h.client.NS, "tcp", harness.Addr(loopLate, 0))
	futureSvc := harness.ClusterIPService("future", harness.TCPPort("tcp", 80, echoPort))
	futureSvc.Spec.ClusterIP = futureClusterIP.String()
	future := h.serve(ctx, t, futureSvc)
	harness.ApplySlice(ctx, t, h.c.Client, harness.Slice(future, harness.Endpoint{IP: h.p1.IP, Node: nodeName, Name: "p1"}))
	waitAnswer(t, h.client.NS, "tcp", harness.Addr(future, 0))

	loopOnly := harness.CreateService(ctx, t, h.c.Client, harness.ClusterIPService("loop-only", harness.TCPPort("tcp", 7003, echoPort)))
	t.Cleanup(func() { harness.DeleteService(context.Background(), t, h.c.Client, loopOnly.Namespace, loopOnly.Name) })
	harness.ApplySlice(ctx, t, h.c.Client, selfSlice(loopOnly, "own", netip.MustParseAddr(loopOnly.Spec.ClusterIP), loopOnly.Spec.Ports[0].Port))

	loops := []*corev1.Service{loopCIP, loopNP, loopLate, loopOnly}
	// The proxy says which service's endpoints it refused.
	refusals := map[string]string{}
	logErr := harness.Eventually(ctx, converge, func() error {
		for _, svc := range loops {
			key := harness.Namespace + "/" + svc.Name + ":tcp"
			for _, line := range strings.Split(h.proxy.Log(), "\n") {
				if strings.Contains(line, "point back at the proxy") && strings.Contains(line, key) {
					refusals[svc.Name] = line
				}
			}
			if refusals[svc.Name] == "" {
				return fmt.Errorf("no refusal naming %s in the proxy's log", key)
			}
		}
		return nil
	})
	if logErr != nil {
		// Not fatal: the connections below show what the proxy does with the endpoints.
		t.Errorf("the proxy did not log the refusals within %v: %v", converge, logErr)
	}
	for _, svc := range loops {
		t.Logf("refusal of %s: %s", svc.Name, refusals[svc.Name])
	}
	// Each refused endpoint is named.
	for name, want := range map[string][]string{
		"loop-cip":  {harness.Addr(h.canary, 0), harness.Addr(loopCIP, 0)},
		"loop-np":   {harness.NodePortAddr(h.node.IP, target, 0)},
		"loop-late": {netip.AddrPortFrom(futureClusterIP, 80).String()},
		"loop-only": {harness.Addr(loopOnly, 0)},
	} {
		for _, w := range want {
			if !strings.Contains(refusals[name], w) {
				t.Errorf("the refusal of %s does not name endpoint %s: %s", name, w, refusals[name])
			}
		}
	}

	before := h.fds(t)
	sampler := h.sampleFDs()
	answers := map[string]int{}
	const rounds = 6 // round robin over the endpoints would reach a self endpoint within 3
	for _, svc := range loops[:3] {
		for _, fr := range []from{{"pod", h.clientPod.NS}, {"outside", h.client.NS}} {
			for range rounds {
				a, err := harness.AskTimeout(ctx, fr.ns, "tcp", harness.Addr(svc, 0), 3*time.Second)
				if err != nil {
					t.Errorf("%s from %s: %v", svc.Name, fr.name, err)
					continue
				}
				answers[svc.Name+" by "+a.Backend]++
				if a.Backend != "p2" {
					t.Errorf("%s from %s answered by %s: the proxy connected to itself (want p2 only)", svc.Name, fr.name, a.Backend)
				}
			}
		}
	}
	// One connection each to the service whose only endpoint is itself.
	for _, fr := range []from{{"pod", h.clientPod.NS}, {"outside", h.client.NS}} {
		a, err := harness.AskTimeout(ctx, fr.ns, "tcp", harness.Addr(loopOnly, 0), 3*time.Second)
		if err == nil {
			t.Errorf("loop-only (its only endpoint is its own ClusterIP) from %s answered by %s", fr.name, a.Backend)
			continue
		}
		answers["loop-only "+harness.KindOf(err).String()]++
		t.Logf("loop-only from %s: %v", fr.name, err)
	}
	peak := sampler.Max()
	after := h.fds(t)
	t.Logf("MEASURE self-loop: answers %v; proxy descriptors before %d, peak %d, after %d", answers, before, peak, after)
	if peak > before+2*fdSlack {
		t.Errorf("the proxy's descriptors went from %d to %d while a client connected to self-loop services one connection at a time", before, peak)
	}
	h.served(ctx, t, "with self-loop endpoints")
	for _, svc := range append(loops, target, future) {
		harness.DeleteService(ctx, t, h.c.Client, svc.Namespace, svc.Name)
	}
	h.served(ctx, t, "after the self-loop case")
	h.settle(t, "self-loop")
}

// hostileProxyPort connects straight to the proxy ports of the canary (a ClusterIP-only
// service) from outside, from a pod and from the node: refused, never answered.
func hostileProxyPort(ctx context.Context, t *testing.T, h *hostile) {
	listing := harness.IPTablesSave(t, h.node.NS)
	ports := map[string]int{"tcp": proxyPort(t, listing, "canary", "tcp"), "udp": proxyPort(t, listing, "canary", "udp")}
	socks := harness.Sockets(t, h.node.NS)
	for network, p := range ports {
		if !hasPort(socks, p) {
			t.Fatalf("nothing listens on the canary's %s proxy port %d: refusals would prove nothing:\n%s", network, p, socks)
		}
	}
	before := h.fds(t)
	results := map[string]int{}
	for _, tc := range []struct {
		name string
		ns   *netns.NS
		ip   netip.Addr
	}{
		{"outside", h.client.NS, h.node.IP},
		{"pod", h.clientPod.NS, h.node.IP},
		{"node", h.node.NS, h.node.IP},
		{"node loopback", h.node.NS, netip.MustParseAddr("127.0.0.1")},
	} {
		for _, network := range []string{"tcp", "udp"} {
			addr := netip.AddrPortFrom(tc.ip, uint16(ports[network])).String()
			a, err := harness.AskTimeout(ctx, tc.ns, network, addr, 2*time.Second)
			k := harness.KindOf(err)
			results[network+" "+k.String()]++
			t.Logf("%s %s from %s: %v", network, addr, tc.name, err)
			switch {
			case err == nil:
				t.Errorf("%s %s (a proxy port) from %s answered by %s", network, addr, tc.name, a.Backend)
			case network == "tcp" && k != harness.Refused && k != harness.Reset:
				t.Errorf("tcp %s (a proxy port) from %s: %v, want refused or reset", addr, tc.name, err)
			}
		}
	}
	t.Logf("MEASURE direct proxy port access: %v; proxy descriptors before %d, after %d", results, before, h.fds(t))
	h.served(ctx, t, "after direct proxy port access")
	h.settle(t, "direct proxy port access")
}

// hostileSourceRanges serves a LoadBalancer service on lbIP to its loadBalancerSourceRanges only.
func hostileSourceRanges(ctx context.Context, t *testing.T, h *hostile) {
	s := harness.NodePortService("lbsr", harness.TCPPort("tcp", 9000, echoPort))
	s.Spec.Type = corev1.ServiceTypeLoadBalancer
	s.Spec.LoadBalancerSourceRanges = []string{outsideRange.String()}
	svc := h.serve(ctx, t, s)
	svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: lbIP.String()}}
	svc, err := h.c.Client.CoreV1().Services(svc.Namespace).UpdateStatus(ctx, svc, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	addr := netip.AddrPortFrom(lbIP, 9000).String()
	// waitRules waits for the rules of lbIP to match only the given range.
	waitRules := func(r netip.Prefix) {
		t.Helper()
		harness.WaitFor(t, converge, func() error {
			var lb []string
			for _, l := range harness.RulesFor(harness.IPTablesSave(t, h.node.NS), harness.Namespace, "lbsr") {
				if strings.Contains(l, "-d "+lbIP.String()+"/32") && (strings.Contains(l, "-j REDIRECT") || strings.Contains(l, "-j DNAT")) {
					lb = append(lb, l)
				}
			}
			if len(lb) == 0 {
				return errors.New("no redirect of the load-balancer IP yet")
			}
			for _, l := range lb {
				if !strings.Contains(l, "-s "+r.String()) {
					return fmt.Errorf("a redirect of the load-balancer IP not limited to %s: %s", r, l)
				}
			}
			return nil
		})
	}
	setRanges := func(r netip.Prefix) {
		t.Helper()
		cur, err := h.c.Client.CoreV1().Services(svc.Namespace).Get(ctx, svc.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cur.Spec.LoadBalancerSourceRanges = []string{r.String()}
		if _, err := h.c.Client.CoreV1().Services(svc.Namespace).Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		waitRules(r)
	}
	refusedOutside := func(what string) {
		t.Helper()
		for i := range 3 {
			a, err := harness.AskTimeout(ctx, h.client.NS, "tcp", addr, time.Second)
			if err == nil {
				t.Errorf("%s: %s answered by %s to the outside client, whose address %s the ranges leave out", what, addr, a.Backend, h.client.IP)
			} else if i == 0 {
				t.Logf("MEASURE loadBalancerSourceRanges %s: %s from the outside client: %s after %v", what, addr, harness.KindOf(err), err.(*harness.RequestError).Elapsed.Round(time.Millisecond))
			}
		}
	}
	waitRules(outsideRange)
	refusedOutside("created without the client")
	// Nor through the service's proxy port.
	pp := netip.AddrPortFrom(h.node.IP, uint16(proxyPort(t, harness.IPTablesSave(t, h.node.NS), "lbsr", "tcp"))).String()
	if a, err := harness.AskTimeout(ctx, h.client.NS, "tcp", pp, 2*time.Second); err == nil {
		t.Errorf("the proxy port %s of the restricted service answered the outside client (by %s)", pp, a.Backend)
	} else if k := harness.KindOf(err); k != harness.Refused && k != harness.Reset {
		t.Errorf("the proxy port %s of the restricted service: %v, want refused or reset", pp, err)
	}

	clientRange := netip.PrefixFrom(h.client.IP, 32)
	setRanges(clientRange)
	waitAnswer(t, h.client.NS, "tcp", addr)
	expectBackends(ctx, t, h.client.NS, "tcp", addr, 3, "p2")

	setRanges(outsideRange)
	refusedOutside("changed to leave the client out")
	h.served(ctx, t, "with loadBalancerSourceRanges")
	harness.DeleteService(ctx, t, h.c.Client, svc.Namespace, svc.Name)
	h.settle(t, "loadBalancerSourceRanges")
}

// hostileExcludedNodePort connects to a NodePort on a node address that --nodeport-addresses
// leaves out: refused at once, not accepted and left hanging.
func hostileExcludedNodePort(ctx context.Context, t *testing.T, h *hostile) {
	svc := h.serve(ctx, t, harness.NodePortService("npx", harness.TCPPort("tcp", 80, echoPort), harness.UDPPort("udp", 53, echoPort)))
	for i, network := range []string{"tcp", "udp"} {
		waitAnswer(t, h.client.NS, network, harness.NodePortAddr(h.node.IP, svc, i))
	}
	port := int(svc.Spec.Ports[0].NodePort)
	if !harness.PortHeld(t, h.node.NS, "tcp", port) {
		t.Errorf("TCP NodePort %d is not held", port)
	}
	before := h.fds(t)
	for _, fr := range []from{{"outside", h.client.NS}, {"node", h.node.NS}} {
		for i, network := range []string{"tcp", "udp"} {
			addr := harness.NodePortAddr(excludedAddr, svc, i)
			a, err := harness.AskTimeout(ctx, fr.ns, network, addr, 2*time.Second)
			switch {
			case err == nil:
				t.Errorf("%s %s (an address --nodeport-addresses leaves out) from %s answered by %s", network, addr, fr.name, a.Backend)
			case network == "tcp" && harness.KindOf(err) != harness.Refused:
				t.Errorf("tcp %s (an address --nodeport-addresses leaves out) from %s: %v, want refused", addr, fr.name, err)
			default:
				t.Logf("MEASURE excluded NodePort address: %s %s from %s: %s after %v", network, addr, fr.name, harness.KindOf(err), err.(*harness.RequestError).Elapsed.Round(time.Millisecond))
			}
		}
	}
	t.Logf("MEASURE excluded NodePort address: proxy descriptors before %d, after %d", before, h.fds(t))
	h.served(ctx, t, "after connections to the excluded address")
	harness.DeleteService(ctx, t, h.c.Client, svc.Namespace, svc.Name)
	h.settle(t, "excluded NodePort address")
}
