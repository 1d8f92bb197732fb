//go:build linux

package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// manifestsYAML is a ClusterIP service (TCP and UDP) and a NodePort service with their slices;
// endpoints are filled in by the test.
const manifestsYAML = `apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.7.7
  ports:
  - {name: tcp, port: 80, targetPort: %[1]d}
  - {name: udp, port: 53, protocol: UDP, targetPort: %[1]d}
---
apiVersion: v1
kind: Service
metadata: {name: np, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.7.8
  ports:
  - {name: tcp, port: 80, targetPort: %[1]d, nodePort: 30080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: default
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports:
- {name: tcp, port: %[1]d, protocol: TCP}
- {name: udp, port: %[1]d, protocol: UDP}
endpoints:
%[2]s
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: np-1
  namespace: default
  labels: {kubernetes.io/service-name: np}
addressType: IPv4
ports:
- {name: tcp, port: %[1]d, protocol: TCP}
endpoints:
%[2]s
`

// writeManifests (re)writes the manifest file with the given pods as endpoints of both services,
// atomically (a rename), as a ConfigMap volume or a careful editor would.
func writeManifests(t *testing.T, dir string, pods ...*netns.Pod) {
	t.Helper()
	var eps strings.Builder
	for _, p := range pods {
		fmt.Fprintf(&eps, "- addresses: [%q]\n  conditions: {ready: true}\n  nodeName: %s\n", p.IP, nodeName)
	}
	tmp := filepath.Join(dir, ".services.yaml.tmp")
	if err := os.WriteFile(tmp, fmt.Appendf(nil, manifestsYAML, echoPort, eps.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "services.yaml")); err != nil {
		t.Fatal(err)
	}
}

// TestManifests runs the basic ClusterIP and NodePort cases with services from a directory of
// manifests instead of an API server, including a change of the directory while running.
func TestManifests(t *testing.T) {
	n := netns.NewNetwork(t, "e2m")
	node := n.AddNode(t, "mn")
	var pods []*netns.Pod
	for i := 1; i <= 2; i++ {
		p := n.AddPod(t, node, fmt.Sprintf("m%d", i))
		harness.StartEcho(t, p.NS, fmt.Sprintf("p%d", i), echoPort)
		pods = append(pods, p)
	}
	clientPod := n.AddPod(t, node, "mcli")
	client := n.AddClient(t, "mout")
	client.Run(t, "ip", "route", "add", "10.96.0.0/16", "via", node.IP.String())
	dir := t.TempDir()
	writeManifests(t, dir, pods[0])

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	webTCP, webUDP := "10.96.7.7:80", "10.96.7.7:53"
	nodePort := netip.AddrPortFrom(node.IP, 30080).String()
	first := harness.StartProxy(t, node.NS, harness.ProxyConfig{
		NodeName:  nodeName,
		Manifests: dir,
		Args:      []string{"--iptables-sync-period=" + syncPeriod.String(), "--iptables-min-sync-period=100ms"},
		Ready: func(ctx context.Context) error {
			_, err := harness.Ask(ctx, clientPod.NS, "tcp", webTCP)
			return err
		},
	})
	everywhere := []from{{"pod", clientPod.NS}, {"node", node.NS}, {"outside", client.NS}}
	check := func(t *testing.T, want ...string) {
		for _, fr := range everywhere {
			t.Run(fr.name, func(t *testing.T) {
				for _, c := range []struct{ network, addr string }{{"tcp", webTCP}, {"udp", webUDP}, {"tcp", nodePort}} {
					waitAnswer(t, fr.ns, c.network, c.addr)
					expectBackends(ctx, t, fr.ns, c.network, c.addr, 3*len(want), want...)
				}
			})
		}
	}
	t.Run("ClusterIP and NodePort", func(t *testing.T) { check(t, "p1") })
	localNodePort := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), 30080).String()
	t.Run("NodePort on 127.0.0.1 from the node (--iptables-localhost-nodeports default true)", func(t *testing.T) {
		waitAnswer(t, node.NS, "tcp", localNodePort)
		expectBackends(ctx, t, node.NS, "tcp", localNodePort, 3, "p1")
	})
	t.Run("a second instance without hand-over leaves the first serving", func(t *testing.T) {
		// What a DaemonSet rolling update with maxSurge, or an operator by mistake, does: the
		// second instance finds the instance lock held and exits before it touches a rule.
		before := harness.RulesFor(harness.IPTablesSave(t, node.NS), harness.Namespace, "web")
		if len(before) == 0 {
			t.Fatal("no rules of web: the case proves nothing")
		}
		sctx, scancel := context.WithTimeout(ctx, 30*time.Second)
		defer scancel()
		// Without a hand-over socket (TestHandover covers the hand-over).
		out, err := node.NS.Exec(sctx, append(first.Args, "--handover-socket=none")...)
		if err == nil || !strings.Contains(out, "another kube-userspace-proxy") {
			t.Fatalf("the second instance: %v, want it to exit naming the running one; output:\n%s", err, out)
		}
		if after := harness.RulesFor(harness.IPTablesSave(t, node.NS), harness.Namespace, "web"); len(after) != len(before) {
			t.Errorf("%d rules of web before the second instance, %d after it", len(before), len(after))
		}
		select {
		case <-first.Done():
			t.Fatalf("the first proxy exited: %v", first.Err())
		default:
		}
		check(t, "p1")
	})
	t.Run("directory changed while running", func(t *testing.T) {
		writeManifests(t, dir, pods[1])
		changed := time.Now()
		harness.WaitFor(t, converge, func() error {
			a, err := harness.Ask(ctx, clientPod.NS, "tcp", webTCP)
			if err != nil {
				return err
			}
			if a.Backend != "p2" {
				return fmt.Errorf("answered by %s, want p2", a.Backend)
			}
			return nil
		})
		t.Logf("manifest change applied within %v", time.Since(changed).Round(time.Millisecond))
		check(t, "p2")
	})
	t.Run("--iptables-localhost-nodeports=false: 127.0.0.1 refused, the node's address served", func(t *testing.T) {
		if err := first.Terminate(30 * time.Second); err != nil {
			t.Fatalf("stopping the first proxy: %v", err)
		}
		harness.StartProxy(t, node.NS, harness.ProxyConfig{
			NodeName:  nodeName,
			Manifests: dir,
			Args:      append(first.Config.Args, "--iptables-localhost-nodeports=false"),
			Ready: func(ctx context.Context) error {
				_, err := harness.Ask(ctx, client.NS, "tcp", nodePort)
				return err
			},
		})
		expectBackends(ctx, t, node.NS, "tcp", nodePort, 3, "p2")
		// Not redirected, the connection meets the socket the proxy holds on [::]:30080,
		// bound without listening: refused, as the flag's help says.
		a, err := harness.AskTimeout(ctx, node.NS, "tcp", localNodePort, 5*time.Second)
		if k := harness.KindOf(err); k != harness.Refused {
			t.Errorf("tcp %s from the node = %q, %v (%v); want refused", localNodePort, a.Backend, err, k)
		}
	})
}
