package e2e

import (
	"context"
	"fmt"
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
	if got := scrape()[netProgCount]; got != 1 {
		t.Errorf("%v observations after changes without a valid trigger time, want still 1", got)
	}
}
