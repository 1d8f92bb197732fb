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

// The dual-stack service of TestDualStack.
var (
	dualIPv4 = netip.MustParseAddr("10.96.0.50")
	dualIPv6 = netip.MustParseAddr("fd00:96::50")
)

const (
	dualName        = "dual"
	dualNodePortTCP = 30090
	dualNodePortUDP = 30091
)

// dualStackYAML is a RequireDualStack NodePort service (TCP and UDP) with one EndpointSlice per
// address family. Arguments: the backends' port, then the IPv4 and the IPv6 endpoints.
const dualStackYAML = `apiVersion: v1
kind: Service
metadata: {name: dual, namespace: default}
spec:
  type: NodePort
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIP: 10.96.0.50
  clusterIPs: [10.96.0.50, "fd00:96::50"]
  ports:
  - {name: tcp, port: 80, targetPort: %[1]d, nodePort: 30090}
  - {name: udp, port: 53, protocol: UDP, targetPort: %[1]d, nodePort: 30091}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: dual-ipv4
  namespace: default
  labels: {kubernetes.io/service-name: dual}
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
  name: dual-ipv6
  namespace: default
  labels: {kubernetes.io/service-name: dual}
addressType: IPv6
ports:
- {name: tcp, port: %[1]d, protocol: TCP}
- {name: udp, port: %[1]d, protocol: UDP}
endpoints:
%[3]s
`

// expectFamily sends n requests from ns to addr and fails unless every one is answered by a
// member of want, every member answers at least once, and every backend saw a peer address of
// the family of addr: the proxy dialled the endpoint of the service address's family.
func expectFamily(ctx context.Context, t *testing.T, ns *netns.NS, network, addr string, n int, want ...string) {
	t.Helper()
	dst := netip.MustParseAddrPort(addr).Addr()
	seen := map[string]int{}
	for i := range n {
		a, err := harness.Ask(ctx, ns, network, addr)
		if err != nil {
			t.Fatalf("request %d (answers so far %v): %v", i, seen, err)
		}
		seen[a.Backend]++
		if a.Peer.Addr().Is6() != dst.Is6() {
			t.Errorf("%s %s from %s: %s saw peer %s, not of the service address's family", network, addr, ns, a.Backend, a.Peer)
		}
	}
	for _, w := range want {
		if seen[w] == 0 {
			t.Errorf("%s %s from %s: %s never answered in %d requests (answers: %v)", network, addr, ns, w, n, seen)
		}
		delete(seen, w)
	}
	if len(seen) > 0 {
		t.Errorf("%s %s from %s: unexpected backends answered: %v", network, addr, ns, seen)
	}
}

// TestDualStack runs a RequireDualStack service from a manifests directory on a node with IPv4
// and IPv6: iptables and ip6tables portals, each family's traffic to that family's endpoints,
// NodePorts on both node addresses, and the IPv6 rules gone after SIGTERM and after --cleanup.
func TestDualStack(t *testing.T) {
	top := t // the proxy outlives subtests
	n := netns.NewDualStackNetwork(t, "e2d")
	node := n.AddNode(t, "dn")
	var pods []*netns.Pod
	var names []string
	var eps4, eps6 strings.Builder
	for i := 1; i <= 2; i++ {
		name := fmt.Sprintf("p%d", i)
		p := n.AddPod(t, node, "d"+name)
		harness.StartEcho(t, p.NS, name, echoPort)
		pods, names = append(pods, p), append(names, name)
		fmt.Fprintf(&eps4, "- addresses: [%q]\n  conditions: {ready: true}\n  nodeName: %s\n", p.IP, nodeName)
		fmt.Fprintf(&eps6, "- addresses: [%q]\n  conditions: {ready: true}\n  nodeName: %s\n", p.IPv6, nodeName)
	}
	clientPod := n.AddPod(t, node, "dcli")
	dir := t.TempDir()
	manifests := fmt.Sprintf(dualStackYAML, echoPort, eps4.String(), eps6.String())
	if err := os.WriteFile(filepath.Join(dir, "dual.yaml"), []byte(manifests), 0o644); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ap := func(ip netip.Addr, port int) string { return netip.AddrPortFrom(ip, uint16(port)).String() }
	everywhere := []from{{"pod", clientPod.NS}, {"node", node.NS}}

	// Without this the IPv6 cases could not tell a proxy bug from a backend deaf to IPv6.
	t.Run("backends serve both families", func(t *testing.T) {
		for _, p := range pods {
			for _, ip := range []netip.Addr{p.IP, p.IPv6} {
				for _, network := range []string{"tcp", "udp"} {
					a, err := harness.Ask(ctx, clientPod.NS, network, ap(ip, echoPort))
					if err != nil {
						t.Fatal(err)
					}
					if a.Peer.Addr() != map[bool]netip.Addr{false: clientPod.IP, true: clientPod.IPv6}[ip.Is6()] {
						t.Errorf("%s %s: peer %s, want the client pod's own address of that family", network, ap(ip, echoPort), a.Peer)
					}
				}
			}
		}
	})

	proxyConfig := harness.ProxyConfig{
		NodeName:  nodeName,
		Manifests: dir,
		Args: []string{
			"--iptables-sync-period=" + syncPeriod.String(),
			"--iptables-min-sync-period=100ms",
			"--service-cluster-ip-range=10.96.0.0/16,fd00:96::/112",
		},
		Ready: func(ctx context.Context) error {
			_, err := harness.Ask(ctx, clientPod.NS, "tcp", ap(dualIPv4, 80))
			return err
		},
	}
	proxy := harness.StartProxy(top, node.NS, proxyConfig)
	t.Logf("proxy ready (IPv4 ClusterIP answers) %v after start", proxy.Ready.Sub(proxy.Started).Round(time.Millisecond))

	// The IPv4 portal answering proves a sync; the IPv6 rules are written right after the IPv4
	// ones, so they may trail it a little.
	portals := t.Run("ip6tables portals", func(t *testing.T) {
		var rules6 []string
		err := harness.Eventually(ctx, converge, func() error {
			rules6 = harness.RulesFor(harness.IP6TablesSave(t, node.NS), harness.Namespace, dualName)
			for _, chain := range []string{"KUBE-PORTALS-CONTAINER", "KUBE-PORTALS-HOST"} {
				for _, port := range []string{"tcp", "udp"} {
					// In the chain, or in its recent chain when a partial sync added it.
					if !hasRule(rules6, "-A "+chain+" ", "-d "+dualIPv6.String()+"/128", harness.Namespace+"/"+dualName+":"+port) &&
						!hasRule(rules6, "-A "+chain+"-NEW ", "-d "+dualIPv6.String()+"/128", harness.Namespace+"/"+dualName+":"+port) {
						return fmt.Errorf("no %s rule for %s commented %s/%s:%s", chain, dualIPv6, harness.Namespace, dualName, port)
					}
				}
			}
			return nil
		})
		if err != nil {
			t.Fatalf("ip6tables-save: %v; rules of the service:\n%s\nproxy log:\n%s", err, strings.Join(rules6, "\n"), proxy.Tail(20))
		}
		for _, r := range rules6 {
			if strings.Contains(r, dualIPv4.String()) {
				t.Errorf("ip6tables-save holds the IPv4 ClusterIP: %s", r)
			}
		}
		rules4 := harness.RulesFor(harness.IPTablesSave(t, node.NS), harness.Namespace, dualName)
		if !hasRule(rules4, "-A KUBE-PORTALS-CONTAINER ", "-d "+dualIPv4.String()+"/32") && !hasRule(rules4, "-A KUBE-PORTALS-CONTAINER-NEW ", "-d "+dualIPv4.String()+"/32") {
			t.Errorf("iptables-save: no KUBE-PORTALS-CONTAINER rule for %s; rules of the service:\n%s", dualIPv4, strings.Join(rules4, "\n"))
		}
		for _, r := range rules4 {
			if strings.Contains(r, dualIPv6.String()) {
				t.Errorf("iptables-save holds the IPv6 ClusterIP: %s", r)
			}
		}
	})
	if !portals {
		t.FailNow() // without IPv6 portals every IPv6 case would only time out
	}

	cases := []struct {
		name, network, addr string
	}{
		{"IPv6 ClusterIP TCP", "tcp", ap(dualIPv6, 80)},
		{"IPv6 ClusterIP UDP", "udp", ap(dualIPv6, 53)},
		{"IPv4 ClusterIP TCP", "tcp", ap(dualIPv4, 80)},
		{"IPv4 ClusterIP UDP", "udp", ap(dualIPv4, 53)},
		{"IPv6 NodePort TCP", "tcp", ap(node.IPv6, dualNodePortTCP)},
		{"IPv6 NodePort UDP", "udp", ap(node.IPv6, dualNodePortUDP)},
		{"IPv4 NodePort TCP", "tcp", ap(node.IP, dualNodePortTCP)},
		{"IPv4 NodePort UDP", "udp", ap(node.IP, dualNodePortUDP)},
	}
	for _, fr := range everywhere {
		for _, c := range cases {
			t.Run(c.name+" from "+fr.name, func(t *testing.T) {
				waitAnswer(t, fr.ns, c.network, c.addr)
				expectFamily(ctx, t, fr.ns, c.network, c.addr, 3*len(names), names...)
			})
		}
	}

	t.Run("SIGTERM removes the portals of both families", func(t *testing.T) {
		if err := proxy.Terminate(30 * time.Second); err != nil {
			t.Fatalf("SIGTERM: %v; log:\n%s", err, proxy.Tail(20))
		}
		if r := harness.RulesFor(harness.IP6TablesSave(t, node.NS), harness.Namespace, dualName); len(r) > 0 {
			t.Errorf("ip6tables rules left after SIGTERM:\n%s", strings.Join(r, "\n"))
		}
		if r := harness.RulesFor(harness.IPTablesSave(t, node.NS), harness.Namespace, dualName); len(r) > 0 {
			t.Errorf("iptables rules left after SIGTERM:\n%s", strings.Join(r, "\n"))
		}
		if a, err := harness.AskTimeout(ctx, clientPod.NS, "tcp", ap(dualIPv6, 80), time.Second); err == nil {
			t.Errorf("IPv6 ClusterIP answered by %s with the proxy stopped", a.Backend)
		}
	})

	t.Run("cleanup after SIGKILL removes both families' chains", func(t *testing.T) {
		proxy = harness.StartProxy(top, node.NS, proxyConfig)
		waitAnswer(t, clientPod.NS, "tcp", ap(dualIPv6, 80)) // the IPv6 portals are in place
		proxy.Stop()                                         // SIGKILL: the rules stay behind
		if !strings.Contains(harness.IP6TablesSave(t, node.NS), "KUBE-PORTALS-CONTAINER") ||
			!strings.Contains(harness.IPTablesSave(t, node.NS), "KUBE-PORTALS-CONTAINER") {
			t.Fatal("no chains of ours in both families before --cleanup: the case proves nothing")
		}
		out := harness.RunCleanup(t, node.NS)
		for tool, rules := range map[string]string{
			"iptables-save":  harness.IPTablesSave(t, node.NS),
			"ip6tables-save": harness.IP6TablesSave(t, node.NS),
		} {
			if strings.Contains(rules, "KUBE-") {
				t.Errorf("after --cleanup (%s) %s still holds KUBE- rules or chains:\n%s", strings.TrimSpace(out), tool, rules)
			}
		}
	})
}

// hasRule reports whether one of rules contains every one of parts.
func hasRule(rules []string, parts ...string) bool {
	for _, r := range rules {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(r, p)
		}
		if all {
			return true
		}
	}
	return false
}
