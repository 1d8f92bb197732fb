//go:build cluster && clustermon

package kcluster

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// TestMonitoringAlerts: the kubernetes-mixin's kube-proxy alerts on the cluster's Prometheus:
// KubeProxyInstanceUnreachable goes pending when one node's proxy stops and KubeProxyDown when
// every proxy is gone, and both resolve when they are back. Their `for: 15m` (kept as the mixin
// ships it) is longer than this test: they are seen pending, not firing. A node is stopped and
// the DaemonSet deleted: build tag clustermon (make test-monitoring), out of make test-cluster.
func TestMonitoringAlerts(t *testing.T) {
	deployProxy(t)
	prom := startMonitoring(t)
	t.Run("targets", func(t *testing.T) { checkTargets(t, prom) })
	t.Run("KubeProxyInstanceUnreachable when a node's proxy stops", func(t *testing.T) {
		instanceUnreachable(t, prom)
	})
	t.Run("KubeProxyDown when every proxy is gone", func(t *testing.T) {
		proxyDown(t, prom)
	})
}

// instanceUnreachable: node-3 powered off (its proxy with it, its pod still in the API): the
// target stays and fails, KubeProxyInstanceUnreachable goes pending for node-3 and KubeProxyDown
// does not; node-3 back, both clear.
func instanceUnreachable(t *testing.T, prom string) {
	const node = "node-3"
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if _, err := clusterSh(ctx, "node-stop", node); err != nil {
		t.Fatal(err)
	}
	started := false
	defer func() {
		if !started {
			_, _ = clusterSh(ctx, "node-start", node)
		}
	}()
	stopped := time.Now()
	waitData(t, prom, `ALERTS{alertname="KubeProxyInstanceUnreachable", alertstate="pending", instance="`+node+`"}`, time.Now().Add(2*time.Minute))
	t.Logf("KubeProxyInstanceUnreachable pending for %s %v after its node stopped", node, time.Since(stopped).Round(time.Second))
	if got, err := promQuery(prom, `ALERTS{alertname="KubeProxyDown"}`); err != nil || len(got) > 0 {
		t.Errorf("KubeProxyDown with two proxies up: %v %v", got, err)
	}
	if got, err := promQuery(prom, `ALERTS{alertname="KubeProxyInstanceUnreachable", instance!="`+node+`"}`); err != nil || len(got) > 0 {
		t.Errorf("KubeProxyInstanceUnreachable for another node: %v %v", got, err)
	}
	started = true
	if _, err := clusterSh(ctx, "node-start", node); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 2*time.Minute, time.Second, "the proxy on "+node+" Ready", func() error {
		p, ok := proxyPods(t)[node]
		if !ok || !podReady(&p) {
			return fmt.Errorf("no Ready proxy pod on %s", node)
		}
		return nil
	})
	waitEmpty(t, prom, `ALERTS{alertname="KubeProxyInstanceUnreachable"}`, 2*time.Minute)
	waitData(t, prom, `up{job="kube-proxy", instance="`+node+`"} == 1`, time.Now().Add(time.Minute))
}

// proxyDown: the DaemonSet deleted, so no proxy pod is left to discover: KubeProxyDown goes
// pending; deployed again (hack/cluster.sh deploy), it clears.
func proxyDown(t *testing.T, prom string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	restored := false
	restore := func() {
		restored = true
		if _, err := clusterSh(ctx, "deploy"); err != nil {
			t.Fatal(err)
		}
	}
	defer func() {
		if !restored {
			restore()
		}
	}()
	kubectl(t, 2*time.Minute, "-n", proxyNS, "delete", "daemonset", proxyName, "--cascade=foreground", "--timeout=100s")
	gone := time.Now()
	waitFor(t, time.Minute, time.Second, "no proxy pod", func() error {
		if pods := proxyPods(t); len(pods) > 0 {
			return fmt.Errorf("%d proxy pods", len(pods))
		}
		return nil
	})
	waitData(t, prom, `ALERTS{alertname="KubeProxyDown", alertstate="pending"}`, time.Now().Add(2*time.Minute))
	t.Logf("KubeProxyDown pending %v after the DaemonSet's deletion", time.Since(gone).Round(time.Second))
	restore()
	waitEmpty(t, prom, `ALERTS{alertname="KubeProxyDown"}`, 2*time.Minute)
	waitFor(t, time.Minute, 2*time.Second, "every node's proxy up again", func() error {
		got, err := promQuery(prom, `count(up{job="kube-proxy"} == 1)`)
		if err != nil {
			return err
		}
		if len(got) != 1 || got[0].value != float64(len(nodes)) {
			return fmt.Errorf("targets up: %v", got)
		}
		return nil
	})
}
