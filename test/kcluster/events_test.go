//go:build cluster

package kcluster

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
)

// eventsNS holds the Service with an invalid annotation.
const eventsNS = "kup-events"

const badServiceYAML = `
apiVersion: v1
kind: Namespace
metadata: {name: kup-events}
---
apiVersion: v1
kind: Service
metadata:
  name: bad-proxy-protocol
  namespace: kup-events
  annotations: {kube-userspace-proxy.io/proxy-protocol: v3}
spec:
  ports: [{name: tcp, port: 80}]
`

// eventTTL is the API server's --event-ttl (its default: hack/cluster.sh sets none).
const eventTTL = time.Hour

// describedEvents returns the lines of the Events table of `kubectl describe` output.
func describedEvents(out string) []string {
	_, table, ok := strings.Cut(out, "\nEvents:")
	if !ok {
		return nil
	}
	var lines []string
	for _, l := range strings.Split(table, "\n") {
		if l = strings.TrimSpace(l); l != "" && l != "<none>" && !strings.HasPrefix(l, "Type ") && !strings.HasPrefix(l, "----") {
			lines = append(lines, l)
		}
	}
	return lines
}

// TestEventsAsKubeProxy: what `kubectl describe` shows of the proxy's Events on the cluster: a
// Service with an invalid kube-userspace-proxy.io/proxy-protocol value has a Warning
// InvalidField Event from kube-userspace-proxy naming the annotation and its value, one from
// each node's proxy (reporting instance kube-userspace-proxy-NODE); every Node has the Normal
// Starting Event of the proxy, listed by kubectl get events as kube-proxy's is.
func TestEventsAsKubeProxy(t *testing.T) {
	deployProxy(t)
	t.Run("Warning on a Service with an invalid field", func(t *testing.T) {
		kubectlApply(t, badServiceYAML)
		t.Cleanup(func() { kubectl(t, 2*time.Minute, "delete", "namespace", eventsNS, "--timeout=100s") })
		const field = "metadata.annotations[kube-userspace-proxy.io/proxy-protocol]"
		var lines []string
		waitFor(t, time.Minute, time.Second, "the InvalidField Event in kubectl describe service", func() error {
			lines = nil
			for _, l := range describedEvents(kubectl(t, 30*time.Second, "-n", eventsNS, "describe", "service", "bad-proxy-protocol")) {
				f := strings.Fields(l)
				if len(f) >= 4 && f[0] == "Warning" && f[1] == "InvalidField" && strings.Contains(l, "kube-userspace-proxy") {
					lines = append(lines, l)
				}
			}
			if len(lines) == 0 {
				return fmt.Errorf("no Warning InvalidField from kube-userspace-proxy")
			}
			return nil
		})
		for _, l := range lines {
			if !strings.Contains(l, field) || !strings.Contains(l, `"v3"`) {
				t.Errorf("the Event does not name the field %s and its value \"v3\": %s", field, l)
			}
		}
		t.Logf("kubectl describe service: %s", strings.Join(lines, "\n"))
		// One a proxy: every node's proxy serves the Service and reports it.
		waitFor(t, time.Minute, time.Second, "an InvalidField Event from each node's proxy", func() error {
			sel := fields.Set{"involvedObject.kind": "Service", "involvedObject.name": "bad-proxy-protocol", "reason": "InvalidField"}.AsSelector().String()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			list, err := env.client.CoreV1().Events(eventsNS).List(ctx, metav1.ListOptions{FieldSelector: sel})
			if err != nil {
				return err
			}
			// The reporting instance is kube-userspace-proxy-<hostname>: the node's name.
			from := map[string]bool{}
			for _, e := range list.Items {
				if e.Type != "Warning" || e.ReportingController != "kube-userspace-proxy" {
					return fmt.Errorf("Event %s: type %s, reporting controller %q", e.Name, e.Type, e.ReportingController)
				}
				from[e.ReportingInstance] = true
			}
			for _, n := range nodes {
				if !from["kube-userspace-proxy-"+n] {
					return fmt.Errorf("no InvalidField Event from the proxy of %s (reporting instances %v)", n, from)
				}
			}
			return nil
		})
	})
	t.Run("Starting on every Node", func(t *testing.T) {
		// Events live an hour: proxies that started longer ago have none left, as kube-proxy's.
		// Restart them then (a rolling update: each new proxy takes over and reports its start).
		for n, p := range proxyPods(t) {
			if time.Since(p.CreationTimestamp.Time) > eventTTL-10*time.Minute {
				t.Logf("the proxy on %s started %v ago: restarting the proxies for fresh Starting Events", n, time.Since(p.CreationTimestamp.Time).Round(time.Minute))
				kubectl(t, 30*time.Second, "-n", proxyNS, "rollout", "restart", "daemonset/"+proxyName)
				kubectl(t, rolloutLimit+30*time.Second, "-n", proxyNS, "rollout", "status", "daemonset/"+proxyName, "--timeout="+rolloutLimit.String())
				break
			}
		}
		// kubectl get events lists them, as kube-proxy's: the Node by name, no UID (kube-proxy's
		// reference, which the end-to-end test compares with ours). kubectl describe node lists
		// only events that name the Node's UID: neither kube-proxy's nor the kubelet's own
		// "Starting kubelet." (checked below, so that a kubectl that starts listing them is seen).
		for _, n := range nodes {
			sel := "involvedObject.kind=Node,involvedObject.name=" + n + ",reason=Starting"
			waitFor(t, time.Minute, time.Second, "the proxy's Starting Event in kubectl get events of "+n, func() error {
				for _, l := range strings.Split(kubectl(t, 30*time.Second, "-n", "default", "get", "events", "--field-selector", sel, "-o", "wide"), "\n") {
					if f := strings.Fields(l); len(f) > 3 && f[1] == "Normal" && f[2] == "Starting" && strings.Contains(l, "kube-userspace-proxy, kube-userspace-proxy-"+n+" ") {
						t.Logf("kubectl get events: %s", strings.Join(f, " "))
						return nil
					}
				}
				return fmt.Errorf("no Normal Starting from kube-userspace-proxy")
			})
			var ours, kubelet bool
			for _, l := range describedEvents(kubectl(t, 30*time.Second, "describe", "node", n)) {
				f := strings.Fields(l)
				if len(f) >= 4 && f[0] == "Normal" && f[1] == "Starting" {
					ours = ours || strings.Contains(l, "kube-userspace-proxy")
					kubelet = kubelet || strings.Contains(l, "kubelet")
				}
			}
			if ours != kubelet {
				t.Errorf("kubectl describe node %s: the proxy's Starting Event listed %v, the kubelet's %v: want both or neither", n, ours, kubelet)
			}
		}
	})
}
