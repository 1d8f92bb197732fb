//go:build linux

package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// Addressing of the fixture beyond the netns plan.
var (
	externalIP   = netip.MustParseAddr("192.168.50.10") // a Service's externalIPs, routed to the node
	lbIP         = netip.MustParseAddr("192.168.60.10") // a load-balancer ingress IP, routed to the node
	excludedAddr = netip.MustParseAddr("192.168.77.1")  // a node address outside --nodeport-addresses
	// localExternalIP is a Service's externalIPs that is also an address of the node.
	localExternalIP = netip.MustParseAddr("192.168.50.11")
)

const (
	nodeName  = "node-a"
	echoPort  = 8080 // every backend pod serves kup-echo on it (TCP and UDP)
	echoPort2 = 8081 // and a second instance, named "<pod>-b", on this one
	// syncPeriod is the proxy's --iptables-sync-period: rules flushed by hand come back within it.
	syncPeriod = 2 * time.Second
	// converge bounds the wait for the proxy to apply a change.
	converge = 30 * time.Second
)

// fixture is one control plane, one node running the proxy, three backend pods and one client
// pod on that node, and a client outside the cluster.
type fixture struct {
	n         *netns.Network
	c         *cluster.Cluster
	node      *netns.Node
	backends  []*netns.Pod // names p1, p2, p3
	names     []string
	clientPod *netns.Pod
	client    *netns.Host
	proxy     *harness.Proxy
}

func (f *fixture) proxyConfig() harness.ProxyConfig {
	return harness.ProxyConfig{
		NodeName:   nodeName,
		Kubeconfig: f.c.Kubeconfig,
		Args: []string{
			"--iptables-sync-period=" + syncPeriod.String(),
			"--iptables-min-sync-period=100ms",
			"--nodeport-addresses=" + f.n.Subnet().String(),
		},
	}
}

// from is a namespace a request is sent from.
type from struct {
	name string
	ns   *netns.NS
}

// everywhere returns the pod, the node and the outside client.
func (f *fixture) everywhere() []from {
	return []from{{"pod", f.clientPod.NS}, {"node", f.node.NS}, {"outside", f.client.NS}}
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{n: netns.NewNetwork(t, "e2e")}
	f.c = cluster.Start(t, cluster.Options{Network: f.n})
	f.node = f.n.AddNode(t, "na")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := f.c.CreateNode(ctx, nodeName, f.node.IP); err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 3; i++ {
		name := fmt.Sprintf("p%d", i)
		pod := f.n.AddPod(t, f.node, name)
		harness.StartEcho(t, pod.NS, name, echoPort)
		harness.StartEcho(t, pod.NS, name+"-b", echoPort2)
		f.backends = append(f.backends, pod)
		f.names = append(f.names, name)
	}
	f.clientPod = f.n.AddPod(t, f.node, "cli")
	f.client = f.n.AddClient(t, "out")
	// The outside client reaches service addresses through the node, as a router would send them.
	for _, dst := range []string{cluster.ServiceCIDR, externalIP.String() + "/32", localExternalIP.String() + "/32", lbIP.String() + "/32", excludedAddr.String() + "/32"} {
		f.client.Run(t, "ip", "route", "add", dst, "via", f.node.IP.String())
	}
	// The outside client routes service addresses through the node, whose own route for them
	// leads back out of the same interface: the kernel would answer with ICMP redirects, which
	// share the per-destination ICMP rate limit with the port-unreachable a REJECT sends, and
	// swallow the refusal of a service without endpoints.
	for _, key := range []string{"net.ipv4.conf.all.send_redirects", "net.ipv4.conf.eth0.send_redirects"} {
		if err := f.node.SetSysctl(key, "0"); err != nil {
			t.Fatal(err)
		}
	}
	// A second node address, outside --nodeport-addresses (on lo: the dummy link type needs a
	// kernel module that may be missing).
	f.node.Run(t, "ip", "addr", "add", excludedAddr.String()+"/32", "dev", "lo")
	f.node.Run(t, "ip", "addr", "add", localExternalIP.String()+"/32", "dev", "lo")
	f.proxy = harness.StartProxy(t, f.node.NS, f.proxyConfig())
	return f
}

// endpoints returns Endpoint values for the backends with the given indexes.
// restartProxy starts the proxy again (the previous one must have stopped), owned by top so it
// outlives the calling subtest, and returns once the client pod gets an answer from addr (TCP).
func (f *fixture) restartProxy(top *testing.T, addr string) {
	cfg := f.proxyConfig()
	cfg.Ready = func(ctx context.Context) error {
		// A short timeout per attempt: a SYN sent before the rules exist is lost, and the
		// kernel would resend it only after a second, which the MEASURE lines would count.
		_, err := harness.AskTimeout(ctx, f.clientPod.NS, "tcp", addr, 200*time.Millisecond)
		return err
	}
	f.proxy = harness.StartProxy(top, f.node.NS, cfg)
}

func (f *fixture) endpoints(idx ...int) []harness.Endpoint {
	var eps []harness.Endpoint
	for _, i := range idx {
		eps = append(eps, harness.Endpoint{IP: f.backends[i].IP, Node: nodeName, Name: f.names[i]})
	}
	return eps
}

// serve creates svc with an EndpointSlice of the given backends and returns the created Service.
func (f *fixture) serve(ctx context.Context, t *testing.T, svc *corev1.Service, idx ...int) *corev1.Service {
	t.Helper()
	created := harness.CreateService(ctx, t, f.c.Client, svc)
	harness.ApplySlice(ctx, t, f.c.Client, harness.Slice(created, f.endpoints(idx...)...))
	return created
}

// expectBackends sends n requests from ns and fails unless every one is answered by a member of
// want and every member answers at least once.
func expectBackends(ctx context.Context, t *testing.T, ns *netns.NS, network, addr string, n int, want ...string) {
	t.Helper()
	seen, err := harness.Backends(ctx, ns, network, addr, n)
	if err != nil {
		t.Fatalf("after %v: %v", seen, err)
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

// waitAnswer waits until a request from ns to addr is answered.
func waitAnswer(t *testing.T, ns *netns.NS, network, addr string) time.Duration {
	t.Helper()
	return harness.WaitFor(t, converge, func() error {
		_, err := harness.Ask(context.Background(), ns, network, addr)
		return err
	})
}

// TestProxy runs the cases of the API-server mode against one control plane and one proxy.
// Subtests run in order and some depend on the proxy the previous ones left running.
func TestProxy(t *testing.T) {
	top := t // processes that must outlive a subtest are started with it
	start := time.Now()
	f := newFixture(t)
	t.Logf("fixture ready in %v (proxy ready %v after start)", time.Since(start).Round(time.Millisecond), f.proxy.Ready.Sub(f.proxy.Started).Round(time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	var web *corev1.Service // TCP+UDP ClusterIP service on p1, p2, p3; used by later cases

	t.Run("ClusterIP TCP and UDP", func(t *testing.T) {
		begin := time.Now()
		web = f.serve(ctx, t, harness.ClusterIPService("web", harness.TCPPort("tcp", 80, echoPort), harness.UDPPort("udp", 53, echoPort)), 0, 1, 2)
		// Short attempts, each on a new connection: a SYN sent before the rules exist would
		// otherwise only be retransmitted after 1s, 3s, ...
		harness.WaitFor(t, converge, func() error {
			_, err := harness.AskTimeout(ctx, f.clientPod.NS, "tcp", harness.Addr(web, 0), 200*time.Millisecond)
			return err
		})
		t.Logf("MEASURE service+endpointslice created → first successful connection from a pod: %v (attempts every %v, 200ms each)", time.Since(begin).Round(time.Millisecond), harness.PollInterval)
		for _, fr := range f.everywhere() {
			t.Run(fr.name, func(t *testing.T) {
				waitAnswer(t, fr.ns, "tcp", harness.Addr(web, 0))
				waitAnswer(t, fr.ns, "udp", harness.Addr(web, 1))
				expectBackends(ctx, t, fr.ns, "tcp", harness.Addr(web, 0), 9, f.names...)
				expectBackends(ctx, t, fr.ns, "udp", harness.Addr(web, 1), 9, f.names...)
			})
		}
	})
	if web == nil {
		t.Fatal("the web service is needed by the remaining cases")
	}

	t.Run("multi-port", func(t *testing.T) {
		svc := f.serve(ctx, t, harness.ClusterIPService("multi", harness.TCPPort("a", 80, echoPort), harness.TCPPort("b", 81, echoPort2)), 0, 1)
		for _, fr := range f.everywhere() {
			t.Run(fr.name, func(t *testing.T) {
				waitAnswer(t, fr.ns, "tcp", harness.Addr(svc, 0))
				waitAnswer(t, fr.ns, "tcp", harness.Addr(svc, 1))
				expectBackends(ctx, t, fr.ns, "tcp", harness.Addr(svc, 0), 6, "p1", "p2")
				expectBackends(ctx, t, fr.ns, "tcp", harness.Addr(svc, 1), 6, "p1-b", "p2-b")
			})
		}
	})

	t.Run("NodePort", func(t *testing.T) {
		svc := f.serve(ctx, t, harness.NodePortService("np", harness.TCPPort("tcp", 80, echoPort), harness.UDPPort("udp", 53, echoPort)), 0, 1)
		for _, fr := range f.everywhere() {
			t.Run(fr.name, func(t *testing.T) {
				for i, network := range []string{"tcp", "udp"} {
					addr := harness.NodePortAddr(f.node.IP, svc, i)
					waitAnswer(t, fr.ns, network, addr)
					expectBackends(ctx, t, fr.ns, network, addr, 6, "p1", "p2")
				}
			})
		}
		// The excluded address serves no NodePort, from anywhere.
		for _, fr := range []from{{"node", f.node.NS}, {"outside", f.client.NS}} {
			t.Run("excluded address from "+fr.name, func(t *testing.T) {
				for i, network := range []string{"tcp", "udp"} {
					addr := harness.NodePortAddr(excludedAddr, svc, i)
					a, err := harness.AskTimeout(ctx, fr.ns, network, addr, time.Second)
					if err == nil {
						t.Errorf("%s %s (not in --nodeport-addresses) answered by %s", network, addr, a.Backend)
					} else {
						t.Logf("%s %s: %v", network, addr, err)
					}
				}
			})
		}
	})

	t.Run("externalIPs", func(t *testing.T) {
		// externalIP is routed to the node by the outside client but is no address of any
		// namespace: served for traffic arriving at the node (pods, whether their veth is a
		// bridge port or not, and the outside) and for the node's own connections, as
		// kube-proxy serves them, instead of going to the real address (the network namespace
		// has no route for it). localExternalIP is an address of the node: served from
		// everywhere.
		bridged := f.n.AddBridgedPod(t, f.node, "brc")
		s := harness.ClusterIPService("ext", harness.TCPPort("tcp", 8000, echoPort), harness.UDPPort("udp", 8000, echoPort))
		s.Spec.ExternalIPs = []string{externalIP.String(), localExternalIP.String()}
		f.serve(ctx, t, s, 1, 2)
		cases := []struct {
			name string
			ip   netip.Addr
			from []from
		}{
			{"routed", externalIP, append(f.everywhere(), from{"bridged pod", bridged.NS})},
			{"local", localExternalIP, append(f.everywhere(), from{"bridged pod", bridged.NS})},
		}
		for _, tc := range cases {
			for _, fr := range tc.from {
				t.Run(tc.name+" from "+fr.name, func(t *testing.T) {
					for _, network := range []string{"tcp", "udp"} {
						addr := netip.AddrPortFrom(tc.ip, 8000).String()
						waitAnswer(t, fr.ns, network, addr)
						expectBackends(ctx, t, fr.ns, network, addr, 6, "p2", "p3")
					}
				})
			}
		}
	})

	t.Run("LoadBalancer ingress IP", func(t *testing.T) {
		s := harness.NodePortService("lb", harness.TCPPort("tcp", 9000, echoPort))
		s.Spec.Type = corev1.ServiceTypeLoadBalancer
		svc := f.serve(ctx, t, s, 0, 2)
		svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: lbIP.String()}}
		if _, err := f.c.Client.CoreV1().Services(svc.Namespace).UpdateStatus(ctx, svc, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		addr := netip.AddrPortFrom(lbIP, 9000).String()
		for _, fr := range f.everywhere() {
			t.Run(fr.name, func(t *testing.T) {
				waitAnswer(t, fr.ns, "tcp", addr)
				expectBackends(ctx, t, fr.ns, "tcp", addr, 6, "p1", "p3")
			})
		}
	})

	t.Run("ClientIP affinity", func(t *testing.T) {
		const timeout = 2
		s := harness.ClusterIPService("sticky", harness.TCPPort("tcp", 80, echoPort), harness.UDPPort("udp", 53, echoPort))
		s.Spec.SessionAffinity = corev1.ServiceAffinityClientIP
		s.Spec.SessionAffinityConfig = &corev1.SessionAffinityConfig{ClientIP: &corev1.ClientIPConfig{TimeoutSeconds: ptr(int32(timeout))}}
		svc := f.serve(ctx, t, s, 0, 1, 2)
		for _, fr := range f.everywhere() {
			t.Run(fr.name, func(t *testing.T) {
				for i, network := range []string{"tcp", "udp"} {
					addr := harness.Addr(svc, i)
					waitAnswer(t, fr.ns, network, addr)
					// Rounds separated by more than the timeout: within a round one backend
					// answers everything; across rounds the choice moves on.
					firsts := map[string]bool{}
					for round := range 3 {
						if round > 0 {
							time.Sleep(timeout*time.Second + 700*time.Millisecond)
						}
						// Ports held: a UDP session of an earlier round outlives the affinity.
						seen, err := harness.BackendsHoldingPorts(t, ctx, fr.ns, network, addr, 8)
						if err != nil {
							t.Fatal(err)
						}
						if len(seen) != 1 {
							t.Errorf("%s %s round %d: answers from %v, want one backend (ClientIP affinity)", network, addr, round, seen)
						}
						for b := range seen {
							firsts[b] = true
						}
					}
					if len(firsts) < 2 {
						t.Errorf("%s %s: the same backend %v answered in all 3 rounds separated by the %ds timeout, want round robin after expiry", network, addr, firsts, timeout)
					}
				}
			})
		}
	})

	t.Run("no endpoints refused at once", func(t *testing.T) {
		svc := harness.CreateService(ctx, t, f.c.Client, harness.ClusterIPService("empty", harness.TCPPort("tcp", 80, echoPort), harness.UDPPort("udp", 53, echoPort)))
		harness.ApplySlice(ctx, t, f.c.Client, harness.Slice(svc))
		// Wait for the rules without sending traffic: the kernel rate-limits the ICMP errors a
		// REJECT sends (net.ipv4.icmp_ratelimit: a burst of 6 per destination, then 1/s), so
		// the budget is kept for the checks.
		harness.WaitFor(t, converge, func() error {
			if r := harness.RulesFor(harness.IPTablesSave(t, f.node.NS), harness.Namespace, "empty"); len(r) < 2 {
				return fmt.Errorf("rules for the service: %q", r)
			}
			return nil
		})
		for _, fr := range f.everywhere() {
			t.Run(fr.name, func(t *testing.T) {
				for i, network := range []string{"tcp", "udp"} {
					addr := harness.Addr(svc, i)
					_, err := harness.AskTimeout(ctx, fr.ns, network, addr, 3*time.Second)
					k := harness.KindOf(err)
					switch {
					case k == harness.Refused:
					case k == harness.Denied && fr.name == "node":
						// A local sender is told by the REJECT in OUTPUT at send time.
					default:
						t.Errorf("%s %s with no endpoints: %v, want refused", network, addr, err)
						continue
					}
					elapsed := err.(*harness.RequestError).Elapsed
					t.Logf("%s %s: %s after %v", network, addr, k, elapsed)
					if network == "tcp" && elapsed > 900*time.Millisecond {
						t.Errorf("%s %s: refused only after %v: the first SYN was not refused (a retransmission was)", network, addr, elapsed)
					}
				}
			})
		}
		// Observation, not a requirement: a burst of requests runs out of the ICMP budget.
		kinds := map[string]int{}
		for range 10 {
			_, err := harness.AskTimeout(ctx, f.clientPod.NS, "udp", harness.Addr(svc, 1), 300*time.Millisecond)
			kinds[harness.KindOf(err).String()]++
		}
		t.Logf("10 UDP requests in a burst from the pod: %v", kinds)
	})

	t.Run("headless and ExternalName have no rules", func(t *testing.T) {
		h := harness.ClusterIPService("headless", harness.TCPPort("tcp", 80, echoPort))
		h.Spec.ClusterIP = corev1.ClusterIPNone
		f.serve(ctx, t, h, 0)
		en := &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "extname", Namespace: harness.Namespace},
			Spec:       corev1.ServiceSpec{Type: corev1.ServiceTypeExternalName, ExternalName: "example.com", Ports: []corev1.ServicePort{harness.TCPPort("tcp", 80, echoPort)}},
		}
		harness.CreateService(ctx, t, f.c.Client, en)
		// A service created after them that answers proves the proxy has seen them.
		marker := f.serve(ctx, t, harness.ClusterIPService("marker", harness.TCPPort("tcp", 80, echoPort)), 0)
		waitAnswer(t, f.node.NS, "tcp", harness.Addr(marker, 0))
		rules := harness.IPTablesSave(t, f.node.NS)
		if len(harness.RulesFor(rules, harness.Namespace, "marker")) == 0 {
			t.Fatalf("no rule for the marker service: the listing cannot prove anything:\n%s", rules)
		}
		for _, name := range []string{"headless", "extname"} {
			if got := harness.RulesFor(rules, harness.Namespace, name); len(got) > 0 {
				t.Errorf("rules for %s:\n%s", name, strings.Join(got, "\n"))
			}
		}
	})

	t.Run("endpoints scaled under traffic", func(t *testing.T) {
		svc := f.serve(ctx, t, harness.ClusterIPService("scale", harness.TCPPort("tcp", 80, echoPort), harness.UDPPort("udp", 53, echoPort)), 0)
		for i, network := range []string{"tcp", "udp"} {
			waitAnswer(t, f.clientPod.NS, network, harness.Addr(svc, i))
		}
		// Every backend keeps serving throughout, so a request fails only if the proxy
		// fails it: none may.
		var requests, failures atomic.Int64
		var mu sync.Mutex
		var failed []string
		loopCtx, stopLoop := context.WithCancel(ctx)
		var wg sync.WaitGroup
		for i, network := range []string{"tcp", "udp"} {
			for _, fr := range []from{{"pod", f.clientPod.NS}, {"node", f.node.NS}} {
				addr := harness.Addr(svc, i)
				wg.Go(func() {
					for loopCtx.Err() == nil {
						_, err := harness.Ask(loopCtx, fr.ns, network, addr)
						if loopCtx.Err() != nil {
							return
						}
						requests.Add(1)
						if err != nil {
							failures.Add(1)
							mu.Lock()
							failed = append(failed, fmt.Sprintf("%s: %v", time.Now().Format("15:04:05.000"), err))
							mu.Unlock()
						}
					}
				})
			}
		}
		steps := [][]int{{0, 1, 2}, {1, 2}, {2}, {0, 2}, {0, 1, 2}, {1}}
		for _, step := range steps {
			harness.ApplySlice(ctx, t, f.c.Client, harness.Slice(svc, f.endpoints(step...)...))
			var want []string
			for _, i := range step {
				want = append(want, f.names[i])
			}
			sort.Strings(want)
			took := harness.WaitFor(t, converge, func() error {
				seen, err := harness.Backends(ctx, f.clientPod.NS, "tcp", harness.Addr(svc, 0), 3*len(step))
				if err != nil {
					return err
				}
				var got []string
				for b := range seen {
					got = append(got, b)
				}
				sort.Strings(got)
				if strings.Join(got, ",") != strings.Join(want, ",") {
					return fmt.Errorf("answers from %v, want %v", got, want)
				}
				return nil
			})
			t.Logf("endpoints → %v applied within %v", want, took.Round(time.Millisecond))
		}
		stopLoop()
		wg.Wait()
		t.Logf("%d requests during %d endpoint changes, %d failed", requests.Load(), len(steps), failures.Load())
		if failures.Load() > 0 {
			t.Errorf("%d of %d requests failed while endpoints changed (every backend kept serving):\n%s", failures.Load(), requests.Load(), strings.Join(failed, "\n"))
		}
		if requests.Load() < 20 {
			t.Errorf("only %d requests were made: the traffic loop proves nothing", requests.Load())
		}
	})

	t.Run("service deleted", func(t *testing.T) {
		svc := f.serve(ctx, t, harness.NodePortService("gone", harness.TCPPort("tcp", 80, echoPort), harness.UDPPort("udp", 53, echoPort)), 0)
		waitAnswer(t, f.clientPod.NS, "tcp", harness.Addr(svc, 0))
		waitAnswer(t, f.clientPod.NS, "udp", harness.Addr(svc, 1))
		before := harness.RulesFor(harness.IPTablesSave(t, f.node.NS), harness.Namespace, "gone")
		proxyPorts := redirectPorts(before)
		if len(proxyPorts) == 0 {
			t.Fatalf("no proxy port found in the rules of the service:\n%s", strings.Join(before, "\n"))
		}
		ports := proxyPorts
		socks := harness.Sockets(t, f.node.NS)
		for _, p := range ports {
			if !hasPort(socks, p) {
				t.Errorf("proxy listener port %d not open before the delete:\n%s", p, socks)
			}
		}
		nodePorts := map[string]int{"tcp": int(svc.Spec.Ports[0].NodePort), "udp": int(svc.Spec.Ports[1].NodePort)}
		for network, p := range nodePorts {
			if !harness.PortHeld(t, f.node.NS, network, p) {
				t.Errorf("%s NodePort %d not held before the delete", network, p)
			}
		}
		harness.DeleteService(ctx, t, f.c.Client, svc.Namespace, svc.Name)
		harness.WaitFor(t, converge, func() error {
			if r := harness.RulesFor(harness.IPTablesSave(t, f.node.NS), harness.Namespace, "gone"); len(r) > 0 {
				return fmt.Errorf("rules left:\n%s", strings.Join(r, "\n"))
			}
			socks := harness.Sockets(t, f.node.NS)
			for _, p := range ports {
				if hasPort(socks, p) {
					return fmt.Errorf("port %d still open:\n%s", p, socks)
				}
			}
			for network, p := range nodePorts {
				if harness.PortHeld(t, f.node.NS, network, p) {
					return fmt.Errorf("%s NodePort %d still held", network, p)
				}
			}
			return nil
		})
		if a, err := harness.AskTimeout(ctx, f.clientPod.NS, "tcp", harness.Addr(svc, 0), time.Second); err == nil {
			t.Errorf("deleted service still answered by %s", a.Backend)
		}
	})

	t.Run("rules flushed by hand are restored", func(t *testing.T) {
		addr := harness.Addr(web, 0)
		waitAnswer(t, f.clientPod.NS, "tcp", addr)
		f.node.Run(t, "iptables", "-w", "-t", "nat", "-F", "KUBE-PORTALS-CONTAINER")
		flushed := time.Now()
		if _, err := harness.AskTimeout(ctx, f.clientPod.NS, "tcp", addr, time.Second); err == nil {
			t.Log("the pod still reached the service right after the flush (a sync came first)")
		}
		harness.WaitFor(t, 5*syncPeriod+converge/3, func() error {
			_, err := harness.Ask(ctx, f.clientPod.NS, "tcp", addr)
			return err
		})
		t.Logf("traffic from the pod flows again %v after the flush (sync period %v)", time.Since(flushed).Round(time.Millisecond), syncPeriod)
		if len(harness.RulesFor(harness.IPTablesSave(t, f.node.NS), harness.Namespace, "web")) == 0 {
			t.Error("rules of web not restored")
		}
	})

	t.Run("SIGTERM removes portals and restart recovers", func(t *testing.T) {
		addr := harness.Addr(web, 0)
		// A UDP client that keeps its socket (a DNS forwarder, say): its flow's conntrack entry
		// points at the old proxy's port, which the restarted proxy does not reuse.
		udp, err := f.clientPod.NS.DialContext(ctx, "udp", harness.Addr(web, 1))
		if err != nil {
			t.Fatal(err)
		}
		defer udp.Close()
		ask := func() error {
			if _, err := udp.Write([]byte("ping\n")); err != nil {
				return err
			}
			_ = udp.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
			buf := make([]byte, 512)
			n, err := udp.Read(buf)
			if err != nil {
				return err
			}
			if !strings.HasSuffix(string(buf[:n]), "ping\n") {
				return fmt.Errorf("answer %q", buf[:n])
			}
			return nil
		}
		harness.WaitFor(t, converge, ask)
		if err := f.proxy.Terminate(30 * time.Second); err != nil {
			t.Fatalf("SIGTERM: %v; log:\n%s", err, f.proxy.Tail(20))
		}
		if r := harness.RulesFor(harness.IPTablesSave(t, f.node.NS), harness.Namespace, "web"); len(r) > 0 {
			t.Errorf("portals left after SIGTERM:\n%s", strings.Join(r, "\n"))
		}
		if a, err := harness.AskTimeout(ctx, f.clientPod.NS, "tcp", addr, time.Second); err == nil {
			t.Errorf("service answered by %s with the proxy stopped", a.Backend)
		}
		restarted := time.Now()
		f.restartProxy(top, addr)
		t.Logf("MEASURE restart → traffic flows again: %v", time.Since(restarted).Round(time.Millisecond))
		for _, fr := range f.everywhere() {
			expectBackends(ctx, t, fr.ns, "tcp", addr, 6, f.names...)
		}
		// The restarted proxy deleted the stale flow (retrying if the conntrack tool failed): the
		// same socket is answered again. A failure says what the proxy and conntrack saw.
		waited := time.Now()
		if err := harness.Eventually(ctx, converge, ask); err != nil {
			ct, ctErr := f.node.NS.Exec(ctx, "conntrack", "-L", "-p", "udp")
			t.Fatalf("the old UDP socket is not answered %v after the restart: %v\nconntrack -L -p udp in the node (%v):\n%s\nproxy log:\n%s",
				time.Since(waited).Round(time.Millisecond), err, ctErr, ct, f.proxy.Tail(60))
		}
		t.Logf("MEASURE restart → the old UDP socket is answered again: %v", time.Since(waited).Round(time.Millisecond))
	})

	t.Run("killed proxy: the restart replaces its stale rules", func(t *testing.T) {
		addr := harness.Addr(web, 0)
		waitAnswer(t, f.clientPod.NS, "tcp", addr)
		before := harness.RulesFor(harness.IPTablesSave(t, f.node.NS), harness.Namespace, "web")
		if len(redirectPorts(before)) == 0 {
			t.Fatalf("no proxy port found in the rules of web:\n%s", strings.Join(before, "\n"))
		}
		f.proxy.Stop() // SIGKILL: no cleanup, the rules point at ports nobody listens on
		if stale := harness.RulesFor(harness.IPTablesSave(t, f.node.NS), harness.Namespace, "web"); len(stale) != len(before) {
			t.Fatalf("%d rules of web before the kill, %d after it: the case proves nothing", len(before), len(stale))
		}
		restarted := time.Now()
		f.restartProxy(top, addr)
		t.Logf("MEASURE restart after SIGKILL → traffic flows again: %v", time.Since(restarted).Round(time.Millisecond))
		after := harness.RulesFor(harness.IPTablesSave(t, f.node.NS), harness.Namespace, "web")
		if len(after) != len(before) {
			t.Errorf("%d rules of web before the kill, %d after the restart (stale ones kept?):\n%s",
				len(before), len(after), strings.Join(after, "\n"))
		}
		socks := harness.Sockets(t, f.node.NS)
		for _, p := range redirectPorts(after) {
			if !hasPort(socks, p) {
				t.Errorf("a rule of web redirects to port %d, where nothing listens:\n%s", p, socks)
			}
		}
		for _, fr := range f.everywhere() {
			expectBackends(ctx, t, fr.ns, "tcp", addr, 6, f.names...)
		}
	})

	t.Run("1000 services", func(t *testing.T) {
		measureBigSync(ctx, t, f, 1000)
	})

	t.Run("cleanup removes everything", func(t *testing.T) {
		f.proxy.Stop() // SIGKILL: the rules stay behind
		if !strings.Contains(harness.IPTablesSave(t, f.node.NS), "KUBE-PORTALS-CONTAINER") {
			t.Fatal("no rules of ours before --cleanup: the case proves nothing")
		}
		out := harness.RunCleanup(t, f.node.NS)
		if rules := harness.IPTablesSave(t, f.node.NS); strings.Contains(rules, "KUBE-") {
			t.Errorf("after --cleanup (%s) iptables-save still holds KUBE- rules or chains:\n%s", strings.TrimSpace(out), rules)
		}
	})
}

var redirectRE = regexp.MustCompile(`--to-ports (\d+)|--to-destination [0-9.]+:(\d+)`)

// redirectPorts returns the proxy ports that rules redirect or DNAT to.
func redirectPorts(rules []string) []int {
	set := map[int]bool{}
	for _, r := range rules {
		for _, m := range redirectRE.FindAllStringSubmatch(r, -1) {
			s := m[1] + m[2]
			if p, err := strconv.Atoi(s); err == nil {
				set[p] = true
			}
		}
	}
	var out []int
	for p := range set {
		out = append(out, p)
	}
	sort.Ints(out)
	return out
}

// hasPort reports whether an `ss -Hltnu` listing has a socket on local port p.
func hasPort(ss string, p int) bool {
	suffix := ":" + strconv.Itoa(p)
	for _, line := range strings.Split(ss, "\n") {
		f := strings.Fields(line)
		if len(f) >= 5 && strings.HasSuffix(f[4], suffix) {
			return true
		}
	}
	return false
}

func ptr[T any](v T) *T { return &v }
