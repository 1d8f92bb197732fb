//go:build linux

package e2e

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// churnMetricsAddr is where the proxies of these tests serve metrics, inside their node.
const churnMetricsAddr = "127.0.0.1:10249"

// netProgSeries are the sample names of the network programming histogram's IPv4 series.
const (
	netProgCount = `kubeproxy_network_programming_duration_seconds_count{ip_family="IPv4"}`
	netProgSum   = `kubeproxy_network_programming_duration_seconds_sum{ip_family="IPv4"}`
	// The same observations in the proxy's fine buckets.
	netProgFineCount = `kube_userspace_proxy_network_programming_duration_seconds_count{ip_family="IPv4"}`
	netProgFineSum   = `kube_userspace_proxy_network_programming_duration_seconds_sum{ip_family="IPv4"}`
)

// TestNetworkProgrammingLatency checks kubeproxy_network_programming_duration_seconds against
// kube-proxy's definition on a real API server: a slice whose last-change-trigger-time
// annotation says t0 gives one observation of (time programmed − t0); a change without the
// annotation, or with a time from before the proxy started, gives none.
func TestNetworkProgrammingLatency(t *testing.T) {
	nw := netns.NewNetwork(t, "npl")
	c := cluster.Start(t, cluster.Options{Network: nw})
	node := nw.AddNode(t, "nplnode")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := c.CreateNode(ctx, "nplnode", node.IP); err != nil {
		t.Fatal(err)
	}
	pods := []*netns.Pod{nw.AddPod(t, node, "npl1"), nw.AddPod(t, node, "npl2")}
	harness.StartEcho(t, pods[0].NS, "npl1", echoPort)
	harness.StartEcho(t, pods[1].NS, "npl2", echoPort)
	px := harness.StartProxy(t, node.NS, harness.ProxyConfig{NodeName: "nplnode", Kubeconfig: c.Kubeconfig, MetricsBindAddress: churnMetricsAddr})
	svc := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("npl", harness.TCPPort("http", 80, echoPort)))
	addr := harness.Addr(svc, 0)

	scrape := func() map[string]float64 {
		t.Helper()
		m, err := harness.ScrapeMetrics(node.NS, churnMetricsAddr)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	// answers waits until the service answers from backend name.
	answers := func(name string) {
		t.Helper()
		harness.WaitFor(t, converge, func() error {
			a, err := harness.Ask(ctx, node.NS, "tcp", addr)
			if err == nil && a.Backend != name {
				err = fmt.Errorf("answered by %s, want %s", a.Backend, name)
			}
			return err
		})
	}
	apply := func(trigger string, eps ...harness.Endpoint) time.Time {
		t.Helper()
		s := harness.Slice(svc, eps...)
		if trigger == "" {
			s.Annotations = nil
		} else {
			s.Annotations[corev1.EndpointsLastChangeTriggerTime] = trigger
		}
		applied := time.Now()
		harness.ApplySlice(ctx, t, c.Client, s)
		return applied
	}
	ep := func(i int) harness.Endpoint {
		return harness.Endpoint{IP: pods[i].IP, Node: "nplnode", Name: fmt.Sprintf("npl%d", i+1)}
	}

	// The trigger time is a second before the slice is written: the observation must count the
	// control plane's share, which a latency started when the proxy saw the change leaves out.
	t0 := time.Now()
	time.Sleep(time.Second)
	applied := apply(t0.UTC().Format(time.RFC3339Nano), ep(0))
	answers("npl1")
	var m map[string]float64
	harness.WaitFor(t, converge, func() error {
		m = scrape()
		if m[netProgCount] != 1 {
			return fmt.Errorf("%v observations, want 1", m[netProgCount])
		}
		return nil
	})
	scraped := time.Now()
	if lo, hi := applied.Sub(t0).Seconds(), scraped.Sub(t0).Seconds(); m[netProgSum] < lo || m[netProgSum] > hi {
		t.Errorf("latency %.3f s, want between %.3f s (slice written) and %.3f s (scraped) after the trigger time", m[netProgSum], lo, hi)
	}

	// No annotation: programmed, but no observation.
	apply("", ep(1))
	answers("npl2")
	// A trigger time from before the proxy started: none either.
	apply(px.Started.Add(-time.Minute).UTC().Format(time.RFC3339Nano), ep(0))
	answers("npl1")
	time.Sleep(200 * time.Millisecond) // the observation, if any, follows the balancer's update
	m = scrape()
	if got := m[netProgCount]; got != 1 {
		t.Errorf("%v observations after changes without a valid trigger time, want still 1", got)
	}
	// The fine histogram has the same observations.
	if m[netProgFineCount] != m[netProgCount] || m[netProgFineSum] != m[netProgSum] {
		t.Errorf("fine histogram: count %v sum %v; kube-proxy's: %v and %v", m[netProgFineCount], m[netProgFineSum], m[netProgCount], m[netProgSum])
	}
}

// churnConn is one connection of TestEndpointChurnCorrect's clients.
type churnConn struct {
	client  string
	started time.Time
	backend string
	err     error
}

// TestEndpointChurnCorrect runs rolling updates (an endpoint becomes terminating, a new one
// appears not ready, then ready, then the old one is removed) for a bounded time, on a real API
// server, while clients connect without pause, one of them to a ClientIP-affinity service, and
// checks that: no connection started after an endpoint's removal (or its becoming terminating,
// as ready endpoints remain) was programmed reaches it; none is refused or fails while a ready
// endpoint exists (there always is one); the affinity client sticks to one endpoint until that
// one leaves. "Programmed" is when the proxy's kubeproxy_network_programming_duration_seconds
// counted the update (one observation per slice update, each slice carrying a trigger time).
func TestEndpointChurnCorrect(t *testing.T) {
	const (
		pods    = 6
		active  = 3
		runFor  = 20 * time.Second
		clients = 2
	)
	nw := netns.NewNetwork(t, "chn")
	c := cluster.Start(t, cluster.Options{Network: nw})
	node := nw.AddNode(t, "chnnode")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if _, err := c.CreateNode(ctx, "chnnode", node.IP); err != nil {
		t.Fatal(err)
	}
	var eps []harness.Endpoint
	for i := range pods {
		name := fmt.Sprintf("c%d", i)
		pod := nw.AddPod(t, node, name)
		harness.StartEcho(t, pod.NS, name, echoPort)
		eps = append(eps, harness.Endpoint{IP: pod.IP, Node: "chnnode", Name: name})
	}
	client := nw.AddPod(t, node, "chncli")
	harness.StartProxy(t, node.NS, harness.ProxyConfig{NodeName: "chnnode", Kubeconfig: c.Kubeconfig, MetricsBindAddress: churnMetricsAddr})
	plain := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("churn", harness.TCPPort("http", 80, echoPort)))
	sticky := harness.ClusterIPService("sticky", harness.TCPPort("http", 80, echoPort))
	sticky.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
	sticky = harness.CreateService(ctx, t, c.Client, sticky)

	// The state of the rolling update: the endpoints in the slices, by pod index.
	type state struct{ ready, notReady, terminating []int }
	slicesOf := func(st state) []harness.Endpoint {
		var out []harness.Endpoint
		for _, i := range st.ready {
			out = append(out, eps[i])
		}
		for _, i := range st.notReady {
			e := eps[i]
			e.NotReady = true
			out = append(out, e)
		}
		for _, i := range st.terminating {
			e := eps[i]
			e.Terminating = true
			out = append(out, e)
		}
		return out
	}
	observed := func() float64 {
		m, err := harness.ScrapeMetrics(node.NS, churnMetricsAddr)
		if err != nil {
			t.Fatal(err)
		}
		return m[netProgCount]
	}
	// apply writes both services' slices for st and returns when the proxy has programmed them.
	want := observed()
	apply := func(st state) time.Time {
		t.Helper()
		for _, svc := range []*corev1.Service{plain, sticky} {
			harness.ApplySlice(ctx, t, c.Client, harness.Slice(svc, slicesOf(st)...))
		}
		want += 2
		var at time.Time
		harness.WaitFor(t, converge, func() error {
			if got := observed(); got < want {
				return fmt.Errorf("%v of %v slice updates programmed", got, want)
			}
			at = time.Now()
			return nil
		})
		return at
	}
	st := state{ready: []int{0, 1, 2}}
	apply(st)
	for _, svc := range []*corev1.Service{plain, sticky} {
		harness.WaitFor(t, converge, func() error { _, err := harness.Ask(ctx, client.NS, "tcp", harness.Addr(svc, 0)); return err })
	}

	// Clients: connections without pause until stop, each recorded.
	var (
		mu    sync.Mutex
		conns []churnConn
		wg    sync.WaitGroup
	)
	stop := make(chan struct{})
	run := func(name, addr string) {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			started := time.Now()
			a, err := harness.AskTimeout(ctx, client.NS, "tcp", addr, 5*time.Second)
			mu.Lock()
			conns = append(conns, churnConn{client: name, started: started, backend: a.Backend, err: err})
			mu.Unlock()
		}
	}
	for i := range clients {
		wg.Add(1)
		go run(fmt.Sprintf("plain%d", i), harness.Addr(plain, 0))
	}
	wg.Add(1)
	go run("sticky", harness.Addr(sticky, 0))

	// unusable[name] are the times the pod was not a ready endpoint: from when its becoming
	// terminating was programmed, to when the slice that made it ready again was written.
	unusable := map[string][]churnSpan{}
	begin := time.Now()
	next := active
	steps := 0
	for time.Since(begin) < runFor {
		old, fresh := st.ready[0], next%pods
		next++
		st = state{ready: st.ready[1:], terminating: []int{old}}
		written := time.Now()
		gone := apply(st)
		st.notReady = []int{fresh}
		apply(st)
		st = state{ready: append(st.ready, fresh), terminating: st.terminating}
		if spans := unusable[eps[fresh].Name]; len(spans) > 0 && spans[len(spans)-1].to.IsZero() {
			spans[len(spans)-1].to = time.Now() // usable from the write on
		}
		apply(st)
		st = state{ready: st.ready}
		apply(st)
		unusable[eps[old].Name] = append(unusable[eps[old].Name], churnSpan{written: written, from: gone})
		steps++
	}
	close(stop)
	wg.Wait()
	t.Logf("%d rolling-update steps (%d slice updates) in %v; %d connections", steps, 8*steps, time.Since(begin).Round(time.Millisecond), len(conns))
	if steps < 3 {
		t.Errorf("only %d rolling-update steps ran", steps)
	}

	stickyTo := ""
	for _, cn := range conns {
		if cn.err != nil {
			t.Errorf("%s: connection at %v failed (%v) while ready endpoints existed", cn.client, cn.started.Sub(begin).Round(time.Millisecond), cn.err)
			continue
		}
		if !usableAt(unusable[cn.backend], cn.started) {
			t.Errorf("%s: a connection started at %v reached %s, programmed unusable then", cn.client, cn.started.Sub(begin).Round(time.Millisecond), cn.backend)
		}
		if cn.client == "sticky" {
			if stickyTo != "" && cn.backend != stickyTo && !leftBefore(unusable[stickyTo], cn.started) {
				t.Errorf("affinity client moved from %s to %s while %s was usable", stickyTo, cn.backend, stickyTo)
			}
			stickyTo = cn.backend
		}
	}
}

// churnSpan is a time an endpoint was not usable: from when that was programmed (observed in
// the metric, so a little later) to when the slice that made it usable again was written (zero
// while it lasts); written is when the slice that made it unusable was written.
type churnSpan struct{ written, from, to time.Time }

// leftBefore reports whether a slice that made the endpoint unusable was written before at
// (and the endpoint was not made usable again before at).
func leftBefore(spans []churnSpan, at time.Time) bool {
	for _, sp := range spans {
		if at.After(sp.written) && (sp.to.IsZero() || at.Before(sp.to)) {
			return true
		}
	}
	return false
}

// usableAt reports whether no span of unusability covers at.
func usableAt(spans []churnSpan, at time.Time) bool {
	for _, sp := range spans {
		if at.After(sp.from) && (sp.to.IsZero() || at.Before(sp.to)) {
			return false
		}
	}
	return true
}
