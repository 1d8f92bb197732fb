//go:build linux

package e2e

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// Many services on one node, from a manifests directory, with iptables portals.
//
// TestScale (in `make test`) checks correctness at 10,000 services, not timing.
// TestScaleMeasure (scale_measure_test.go, build tag scalemeasure: `make scale-measure`)
// reports the figures of the issue.

const (
	scaleMetricsAddr = "127.0.0.1:10249"
	// scaleFileSize is how many services (and their slices) each manifest file holds.
	scaleFileSize = 1000
)

// scaleClusterIP is the ClusterIP of scale service i (0 ≤ i < 65,000).
func scaleClusterIP(i int) netip.Addr {
	i++
	return netip.AddrFrom4([4]byte{10, 100, byte(i >> 8), byte(i)})
}

// writeScaleService writes the manifest of service i: a ClusterIP service with one TCP port 80
// and a slice with the single endpoint pod:echoPort.
func writeScaleService(b *strings.Builder, i int, pod netip.Addr) {
	fmt.Fprintf(b, `apiVersion: v1
kind: Service
metadata: {name: s%[1]d, namespace: scale}
spec:
  clusterIP: %[2]s
  ports:
  - {name: tcp, port: 80, targetPort: %[3]d}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: s%[1]d-1
  namespace: scale
  labels: {kubernetes.io/service-name: s%[1]d}
addressType: IPv4
ports:
- {name: tcp, port: %[3]d, protocol: TCP}
endpoints:
- addresses: [%[4]q]
  conditions: {ready: true}
---
`, i, scaleClusterIP(i), echoPort, pod)
}

// writeScaleManifests writes services from..to-1 into dir, scaleFileSize per file, each file by
// rename.
func writeScaleManifests(t testing.TB, dir string, from, to int, pod netip.Addr) {
	t.Helper()
	for f := from; f < to; f += scaleFileSize {
		var b strings.Builder
		for i := f; i < min(f+scaleFileSize, to); i++ {
			writeScaleService(&b, i, pod)
		}
		name := fmt.Sprintf("svc-%06d.yaml", f)
		tmp := filepath.Join(dir, "."+name+".tmp")
		if err := os.WriteFile(tmp, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
}

// scaleEnv is a node with one echo pod, and a manifests directory of n services pointing at it.
type scaleEnv struct {
	node *netns.Node
	pod  *netns.Pod
	dir  string
	n    int
}

func newScaleEnv(t *testing.T, name string, n int) *scaleEnv {
	nw := netns.NewNetwork(t, name)
	node := nw.AddNode(t, name+"n")
	pod := nw.AddPod(t, node, name+"p")
	harness.StartEcho(t, pod.NS, "p1", echoPort)
	dir := t.TempDir()
	writeScaleManifests(t, dir, 0, n, pod.IP)
	// As a directory that was written before the proxy starts (a ConfigMap mounted long ago),
	// not while it starts: no debounce at the first read, no second read of files that changed
	// too close to their first (the idle-CPU figure would count it).
	old := time.Now().Add(-time.Minute)
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, de := range entries {
		if err := os.Chtimes(filepath.Join(dir, de.Name()), old, old); err != nil {
			t.Fatal(err)
		}
	}
	return &scaleEnv{node: node, pod: pod, dir: dir, n: n}
}

// start starts the proxy (not waiting for it) with the metrics server on scaleMetricsAddr.
func (e *scaleEnv) start(t *testing.T, args ...string) *netns.Process {
	cmd := harness.ProxyArgs(t, harness.ProxyConfig{
		NodeName:           nodeName,
		Manifests:          e.dir,
		MetricsBindAddress: scaleMetricsAddr,
		LogLevel:           "info",
		// The range of the manifests' ClusterIPs (scaleClusterIP): none is reported as outside.
		Args: append([]string{"--service-cluster-ip-range=10.100.0.0/16"}, args...),
	})
	if env := strings.Fields(os.Getenv("KUP_SCALE_ENV")); len(env) > 0 { // say GODEBUG=gctrace=1
		cmd = append(append([]string{"env"}, env...), cmd...)
	}
	return e.node.NS.Start(t, cmd...)
}

// sample returns k service indexes spread over 0..n-1, the last one included.
func sampleIndexes(n, k int) []int {
	k = min(k, n)
	out := make([]int, 0, k)
	for j := range k {
		out = append(out, (n-1)-j*n/k)
	}
	return out
}

// waitAll asks every service in idx from ns until each has answered once (or timeout) and
// returns when the last one first answered, and how many never did. Each attempt waits at most
// 150 ms: a SYN sent before the service's rule existed is lost, and waiting for its
// retransmission (1 s) would add up to a second to the figure.
func waitAll(ns *netns.NS, idx []int, timeout time.Duration) (time.Time, int) {
	var mu sync.Mutex
	var last time.Time
	var missing atomic.Int32
	deadline := time.Now().Add(timeout)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	for _, i := range idx {
		wg.Go(func() {
			addr := netip.AddrPortFrom(scaleClusterIP(i), 80).String()
			for {
				sem <- struct{}{}
				_, err := harness.AskTimeout(context.Background(), ns, "tcp", addr, 150*time.Millisecond)
				<-sem
				if err == nil {
					now := time.Now()
					mu.Lock()
					if now.After(last) {
						last = now
					}
					mu.Unlock()
					return
				}
				if time.Now().After(deadline) {
					missing.Add(1)
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	return last, int(missing.Load())
}

// firstServiceAnswer asks the service of index i from ns with a new connection every 5 ms (each
// waiting up to 500 ms for its answer, so attempts overlap and a lost SYN delays nothing) and
// returns when the first answer came; zero if none came before timeout.
func firstServiceAnswer(ns *netns.NS, i int, timeout time.Duration) time.Time {
	addr := netip.AddrPortFrom(scaleClusterIP(i), 80).String()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	answered := make(chan time.Time, 1)
	var wg sync.WaitGroup
	defer wg.Wait()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		wg.Go(func() {
			if _, err := harness.AskTimeout(ctx, ns, "tcp", addr, 500*time.Millisecond); err == nil {
				select {
				case answered <- time.Now():
				default:
				}
			}
		})
		select {
		case at := <-answered:
			cancel()
			return at
		case <-ctx.Done():
			return time.Time{}
		case <-tick.C:
		}
	}
}

// firstFullSync waits for the first full sync in the metrics and returns its duration.
// It polls every 100 ms: call it soon after the start, before the first periodic sync.
func firstFullSync(ns *netns.NS, timeout time.Duration) (time.Duration, error) {
	deadline := time.Now().Add(timeout)
	for {
		m, err := harness.ScrapeMetrics(ns, scaleMetricsAddr)
		if n := m["kubeproxy_sync_full_proxy_rules_duration_seconds_count"]; err == nil && n >= 1 {
			d := time.Duration(m["kubeproxy_sync_full_proxy_rules_duration_seconds_sum"] / n * float64(time.Second))
			if n > 1 {
				return d, fmt.Errorf("%v is the mean of %v full syncs: the first was missed", d, n)
			}
			return d, nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("no full sync in the metrics after %v (%v)", timeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func procStatusKiB(pid int, field string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			return strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	return 0, errors.New("no " + field)
}

func openFDs(pid int) (int, error) {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	return len(ents), err
}

// cpuTicks returns utime+stime of pid in clock ticks (1/100 s).
func cpuTicks(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndex(s, ")")+2:])
	u, _ := strconv.ParseFloat(f[11], 64)
	k, _ := strconv.ParseFloat(f[12], 64)
	return u + k, nil
}

// sinceOrNever is t-from, or -1 when t is zero (never).
func sinceOrNever(from, t time.Time) time.Duration {
	if t.IsZero() {
		return -1
	}
	return t.Sub(from)
}

// redirectRule is a service's portal rule for traffic from containers (pods).
// redirectRule matches a service's redirect, in KUBE-PORTALS-CONTAINER or, when a partial sync
// added it, its recent chain KUBE-PORTALS-CONTAINER-NEW.
var redirectRule = regexp.MustCompile(`^-A KUBE-PORTALS-CONTAINER(?:-NEW)? -d (10\.100\.\d+\.\d+)/32 .*-p tcp .*--dport 80 .*-j REDIRECT --to-ports (\d+)`)

// TestScale runs 10,000 services (one TCP port, one endpoint each) from a manifests directory
// with iptables portals in a node namespace, and checks that the proxy serves all of them: one
// portal rule per service port in the nat table (exactly), a listener on each rule's proxy port,
// and a few hundred services, spread over all of them, answering.
func TestScale(t *testing.T) {
	const n = 10000
	e := newScaleEnv(t, "sc", n)
	started := time.Now()
	p := e.start(t)
	if last, missing := waitAll(e.node.NS, sampleIndexes(n, 300), 90*time.Second); missing > 0 {
		t.Fatalf("%d of 300 sampled services never answered; log:\n%s", missing, p.Tail(30))
	} else {
		t.Logf("300 sampled services answering %v after start", last.Sub(started).Round(time.Millisecond))
	}
	// Every service: its portal rule in the nat table, exactly once, and a listener on its port.
	save := harness.IPTablesSave(t, e.node.NS)
	ports := map[netip.Addr]int{}
	for _, line := range strings.Split(save, "\n") {
		if m := redirectRule.FindStringSubmatch(line); m != nil {
			ip := netip.MustParseAddr(m[1])
			if _, dup := ports[ip]; dup {
				t.Errorf("two redirect rules for %s", ip)
			}
			ports[ip], _ = strconv.Atoi(m[2])
		}
	}
	if len(ports) != n {
		t.Errorf("%d redirect rules, want %d", len(ports), n)
	}
	if host := strings.Count(save, "\n-A KUBE-PORTALS-HOST -d 10.100.") + strings.Count(save, "\n-A KUBE-PORTALS-HOST-NEW -d 10.100."); host != n {
		t.Errorf("%d rules for the node's own traffic (KUBE-PORTALS-HOST), want %d", host, n)
	}
	listening := listeningTCPPorts(t, e.node.NS)
	missing := 0
	for i := range n {
		port, ok := ports[scaleClusterIP(i)]
		switch {
		case !ok:
			missing++
			if missing <= 10 {
				t.Errorf("service %d (%s): no redirect rule", i, scaleClusterIP(i))
			}
		case !listening[port]:
			missing++
			if missing <= 10 {
				t.Errorf("service %d (%s): nothing listens on its proxy port %d", i, scaleClusterIP(i), port)
			}
		}
	}
	if missing > 0 {
		t.Errorf("%d of %d services not programmed", missing, n)
	}
	// Without --profiling nothing samples allocations: the runtime's table of sampled stacks
	// (~1.4 MiB, made at the first sample) is never made.
	if m, err := harness.ScrapeMetrics(e.node.NS, scaleMetricsAddr); err != nil {
		t.Errorf("metrics: %v", err)
	} else if b, ok := m["go_memstats_buck_hash_sys_bytes"]; !ok || b > 64<<10 {
		t.Errorf("go_memstats_buck_hash_sys_bytes = %v (present: %v), want under 64 KiB: allocations are sampled without --profiling", b, ok)
	}
}

// listeningTCPPorts returns the TCP ports listened on in ns (from /proc/net/tcp and tcp6 as seen
// by a process in the namespace).
func listeningTCPPorts(t *testing.T, ns *netns.NS) map[int]bool {
	t.Helper()
	out := map[int]bool{}
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		text := ns.Run(t, "cat", f)
		for _, line := range strings.Split(text, "\n")[1:] {
			fs := strings.Fields(line)
			if len(fs) < 4 || fs[3] != "0A" { // TCP_LISTEN
				continue
			}
			_, hexPort, _ := strings.Cut(fs[1], ":")
			if i := strings.LastIndexByte(fs[1], ':'); i >= 0 {
				hexPort = fs[1][i+1:]
			}
			port, err := strconv.ParseInt(hexPort, 16, 32)
			if err == nil {
				out[int(port)] = true
			}
		}
	}
	return out
}
