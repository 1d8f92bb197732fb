//go:build linux

// Package policy is the end-to-end proof of traffic policies, health checks and metrics on the
// three-node cluster of seed 000: three node namespaces on one bridge, a client outside them, a
// real kube-apiserver, one kube-userspace-proxy per node (--hostname-override node1..3), pod1 on
// node1, pod2 on node2 and no pod on node3.
package policy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/metrics/metricstest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

func TestMain(m *testing.M) { os.Exit(harness.Main(m)) }

const (
	echoPort = 8080
	// syncPeriod is every proxy's --iptables-sync-period; minSync its --iptables-min-sync-period.
	syncPeriod = 2 * time.Second
	minSync    = 100 * time.Millisecond
	converge   = 30 * time.Second
	// dropWait is how long a request to a dropping port waits for an answer that must not come.
	dropWait = 2 * time.Second
)

// lbIP is the load balancer's ingress IP. The outside client routes it via node1 (the "load
// balancer" forwards to node1), and also uses it as the source of health check probes (seed 001).
var lbIP = netip.MustParseAddr("192.168.60.10")

type fixture struct {
	n      *netns.Network
	c      *cluster.Cluster
	nodes  []*netns.Node // node1..node3
	pods   []*netns.Pod  // pod1 on node1, pod2 on node2
	pod3   *netns.Pod    // a client pod on node3, which has no endpoint
	client *netns.Host
	lb     *netns.Host // owns lbIP
}

func nodeName(i int) string { return fmt.Sprintf("node%d", i+1) }

func newFixture(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{n: netns.NewNetwork(t, "pol")}
	f.c = cluster.Start(t, cluster.Options{Network: f.n})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i := range 3 {
		node := f.n.AddNode(t, fmt.Sprintf("n%d", i+1))
		if _, err := f.c.CreateNode(ctx, nodeName(i), node.IP); err != nil {
			t.Fatal(err)
		}
		f.nodes = append(f.nodes, node)
	}
	for i := range 2 {
		pod := f.n.AddPod(t, f.nodes[i], fmt.Sprintf("pod%d", i+1))
		harness.StartEcho(t, pod.NS, fmt.Sprintf("pod%d", i+1), echoPort)
		f.pods = append(f.pods, pod)
	}
	f.pod3 = f.n.AddPod(t, f.nodes[2], "pod3")
	f.client = f.n.AddClient(t, "out")
	f.client.Run(t, "ip", "route", "add", lbIP.String()+"/32", "via", f.nodes[0].IP.String())
	// The load balancer owns the LB IP and probes health checks from it (seed 001); the nodes
	// route the LB IP back to it and check the reverse path strictly.
	f.lb = f.n.AddClient(t, "lb")
	f.lb.Run(t, "ip", "addr", "add", lbIP.String()+"/32", "dev", "lo")
	for _, node := range f.nodes {
		node.Run(t, "ip", "route", "add", lbIP.String()+"/32", "via", f.lb.IP.String())
		for _, k := range []string{"net.ipv4.conf.all.rp_filter", "net.ipv4.conf.eth0.rp_filter"} {
			if err := node.SetSysctl(k, "1"); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i, node := range f.nodes {
		harness.StartProxy(t, node.NS, harness.ProxyConfig{
			NodeName:           nodeName(i),
			Kubeconfig:         f.c.Kubeconfig,
			HealthzBindAddress: "0.0.0.0:10256",
			MetricsBindAddress: "127.0.0.1:10249",
			Args: []string{
				"--iptables-sync-period=" + syncPeriod.String(),
				"--iptables-min-sync-period=" + minSync.String(),
				"--cluster-cidr=" + f.n.ClusterCIDR().String(),
			},
		})
	}
	return f
}

// ep returns the endpoint of pod i (on node i).
func (f *fixture) ep(i int, terminating bool) harness.Endpoint {
	return harness.Endpoint{IP: f.pods[i].IP, Node: nodeName(i), Name: fmt.Sprintf("pod%d", i+1), Terminating: terminating}
}

func expectBackends(ctx context.Context, t *testing.T, ns *netns.NS, addr string, n int, want ...string) {
	t.Helper()
	seen, err := harness.Backends(ctx, ns, "tcp", addr, n)
	if err != nil {
		t.Fatalf("%s from %s: after %v: %v", addr, ns, seen, err)
	}
	for _, w := range want {
		if seen[w] == 0 {
			t.Errorf("%s from %s: %s never answered in %d requests (answers %v)", addr, ns, w, n, seen)
		}
		delete(seen, w)
	}
	if len(seen) > 0 {
		t.Errorf("%s from %s: unexpected backends answered: %v", addr, ns, seen)
	}
}

// expectDropped fails unless a request from ns to addr times out (no answer; a refusal only
// until the rules are in place, see below).
func expectDropped(ctx context.Context, t *testing.T, ns *netns.NS, addr string) {
	t.Helper()
	// A refusal may come before this node's proxy has programmed a service just created (no
	// rule yet: nothing listens there): asked again until the drop is in place, up to
	// converge. An answer is never right.
	deadline := time.Now().Add(converge)
	for {
		a, err := harness.AskTimeout(ctx, ns, "tcp", addr, dropWait)
		if err == nil {
			t.Errorf("%s from %s: answered by %s, want a timeout (drop)", addr, ns, a.Backend)
			return
		}
		k := harness.KindOf(err)
		if k == harness.Timeout {
			return
		}
		if k != harness.Refused || time.Now().After(deadline) {
			t.Errorf("%s from %s: %v (%s), want a timeout (drop)", addr, ns, err, k)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitAnswer waits until addr answers from ns with one of want.
func waitAnswer(t *testing.T, ns *netns.NS, addr string, want ...string) {
	t.Helper()
	harness.WaitFor(t, converge, func() error {
		a, err := harness.Ask(context.Background(), ns, "tcp", addr)
		if err != nil {
			return err
		}
		for _, w := range want {
			if a.Backend == w {
				return nil
			}
		}
		return fmt.Errorf("answered by %s, want one of %v", a.Backend, want)
	})
}

// httpGet sends GET path to addr from a socket in ns, bound to src when valid, and returns the
// status and body.
func httpGet(ctx context.Context, ns *netns.NS, src netip.Addr, addr, path string) (int, string, error) {
	var conn net.Conn
	err := ns.Do(func() error {
		d := net.Dialer{Timeout: 3 * time.Second}
		if src.IsValid() {
			d.LocalAddr = &net.TCPAddr{IP: src.AsSlice()}
		}
		var err error
		conn, err = d.DialContext(ctx, "tcp", addr)
		return err
	})
	if err != nil {
		return 0, "", fmt.Errorf("GET http://%s%s from %s (source %v): %w", addr, path, ns, src, err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(3 * time.Second))
	req, err := http.NewRequest(http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return 0, "", err
	}
	req.Close = true
	if err := req.Write(conn); err != nil {
		return 0, "", fmt.Errorf("GET http://%s%s: %w", addr, path, err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		return 0, "", fmt.Errorf("GET http://%s%s: %w", addr, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

func healthBody(svc string, n int) string {
	return fmt.Sprintf(`{"service":{"namespace":"default","name":%q},"localEndpoints":%d}`, svc, n)
}

// expectHealth waits until node i's health check port answers code and body (from the client,
// or from the load balancer with source lbIP when src is valid) and returns how long that took.
func (f *fixture) expectHealth(t *testing.T, i int, src netip.Addr, port int32, code int, body string) time.Duration {
	t.Helper()
	addr := netip.AddrPortFrom(f.nodes[i].IP, uint16(port)).String()
	from := f.client.NS
	if src.IsValid() {
		from = f.lb.NS
	}
	return harness.WaitFor(t, converge, func() error {
		c, b, err := httpGet(context.Background(), from, src, addr, "/")
		if err != nil {
			return err
		}
		if c != code || b != body {
			return fmt.Errorf("%s: %d %s, want %d %s", nodeName(i), c, b, code, body)
		}
		return nil
	})
}

func TestPolicies(t *testing.T) {
	f := newFixture(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	client := f.client.NS

	t.Run("Cluster: every node's NodePort reaches both pods", func(t *testing.T) {
		svc := harness.CreateService(ctx, t, f.c.Client, harness.NodePortService("cluster", harness.TCPPort("http", 80, echoPort)))
		harness.ApplySlice(ctx, t, f.c.Client, harness.Slice(svc, f.ep(0, false), f.ep(1, false)))
		for i, node := range f.nodes {
			addr := harness.NodePortAddr(node.IP, svc, 0)
			waitAnswer(t, client, addr, "pod1", "pod2")
			expectBackends(ctx, t, client, addr, 12, "pod1", "pod2")
			t.Logf("%s: both pods", nodeName(i))
		}
	})

	// The Local LoadBalancer service of seed 000/003.
	lb := harness.NodePortService("local", harness.TCPPort("http", 80, echoPort))
	lb.Spec.Type = corev1.ServiceTypeLoadBalancer
	lb.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	svc := harness.CreateService(ctx, t, f.c.Client, lb)
	svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: lbIP.String()}}
	if _, err := f.c.Client.CoreV1().Services(svc.Namespace).UpdateStatus(ctx, svc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	hc := svc.Spec.HealthCheckNodePort
	if hc == 0 {
		t.Fatal("the API server allocated no healthCheckNodePort")
	}
	harness.ApplySlice(ctx, t, f.c.Client, harness.Slice(svc, f.ep(0, false), f.ep(1, false)))
	nodePort := func(i int) string { return harness.NodePortAddr(f.nodes[i].IP, svc, 0) }

	t.Run("Local: each node reaches only its own pod, node3 drops", func(t *testing.T) {
		for i, want := range []string{"pod1", "pod2"} {
			waitAnswer(t, client, nodePort(i), want)
			expectBackends(ctx, t, client, nodePort(i), 8, want)
		}
		expectDropped(ctx, t, client, nodePort(2))
	})

	t.Run("Local: LB IP via node1 reaches pod1 only", func(t *testing.T) {
		addr := netip.AddrPortFrom(lbIP, 80).String()
		waitAnswer(t, client, addr, "pod1")
		expectBackends(ctx, t, client, addr, 6, "pod1")
	})

	t.Run("Local: ClusterIP traffic is not affected", func(t *testing.T) {
		// From a pod and from the node on node3, which has no endpoint of its own.
		addr := harness.Addr(svc, 0)
		for _, from := range []*netns.NS{f.pod3.NS, f.nodes[2].NS} {
			waitAnswer(t, from, addr, "pod1", "pod2")
			expectBackends(ctx, t, from, addr, 12, "pod1", "pod2")
		}
	})

	t.Run("Local: the node's own traffic to its NodePort uses every endpoint", func(t *testing.T) {
		expectBackends(ctx, t, f.nodes[0].NS, nodePort(0), 16, "pod1", "pod2")
		// node3 has no local endpoint: outside traffic is dropped there, but the node's own
		// traffic is not (kube-proxy's src-type LOCAL short-circuit).
		expectBackends(ctx, t, f.nodes[2].NS, nodePort(2), 16, "pod1", "pod2")
	})

	t.Run("Local: a pod on node3 reaches the LB IP and node3's NodePort through every endpoint", func(t *testing.T) {
		// Outside traffic is dropped on node3 (no local endpoint), but pod traffic is
		// in-cluster: served by any endpoint, as kube-proxy does with --cluster-cidr.
		from := f.pod3.NS
		for _, addr := range []string{netip.AddrPortFrom(lbIP, 80).String(), nodePort(2)} {
			waitAnswer(t, from, addr, "pod1", "pod2")
			expectBackends(ctx, t, from, addr, 16, "pod1", "pod2")
		}
		expectDropped(ctx, t, client, nodePort(2))
	})

	t.Run("health check node port", func(t *testing.T) {
		for i, want := range []struct {
			code, n int
		}{{200, 1}, {200, 1}, {503, 0}} {
			f.expectHealth(t, i, netip.Addr{}, hc, want.code, healthBody("local", want.n))
		}
	})

	t.Run("health probe from the LB IP is answered", func(t *testing.T) {
		for i, want := range []struct {
			code, n int
		}{{200, 1}, {200, 1}, {503, 0}} {
			f.expectHealth(t, i, lbIP, hc, want.code, healthBody("local", want.n))
		}
	})

	t.Run("scaling pod2 away flips node2 to 503 within one sync", func(t *testing.T) {
		start := time.Now()
		harness.ApplySlice(ctx, t, f.c.Client, harness.Slice(svc, f.ep(0, false)))
		f.expectHealth(t, 1, netip.Addr{}, hc, 503, healthBody("local", 0))
		took := time.Since(start) // from before the update: the API's write counts
		t.Logf("node2 answered 503 %v after the EndpointSlice update", took.Round(time.Millisecond))
		if took > syncPeriod {
			t.Errorf("node2 flipped to 503 after %v, more than one sync period (%v)", took, syncPeriod)
		}
		expectDropped(ctx, t, client, nodePort(1))
		f.expectHealth(t, 0, netip.Addr{}, hc, 200, healthBody("local", 1))
	})

	t.Run("terminating local endpoint: health 503, traffic still served", func(t *testing.T) {
		// kube-proxy counts only ready endpoints for the health check, so a load balancer drains
		// the node, while the terminating pod still gets the node's traffic.
		harness.ApplySlice(ctx, t, f.c.Client, harness.Slice(svc, f.ep(0, true)))
		f.expectHealth(t, 0, netip.Addr{}, hc, 503, healthBody("local", 0))
		expectBackends(ctx, t, client, nodePort(0), 4, "pod1")
	})

	t.Run("internalTrafficPolicy Local", func(t *testing.T) {
		s := harness.ClusterIPService("itp", harness.TCPPort("http", 80, echoPort))
		local := corev1.ServiceInternalTrafficPolicyLocal
		s.Spec.InternalTrafficPolicy = &local
		s = harness.CreateService(ctx, t, f.c.Client, s)
		harness.ApplySlice(ctx, t, f.c.Client, harness.Slice(s, f.ep(0, false), f.ep(1, false)))
		addr := harness.Addr(s, 0)
		for i, want := range []string{"pod1", "pod2"} {
			waitAnswer(t, f.nodes[i].NS, addr, want)
			expectBackends(ctx, t, f.nodes[i].NS, addr, 8, want)
		}
		// Wait for node3's proxy to have the service (its portal then drops).
		harness.WaitFor(t, converge, func() error {
			a, err := harness.AskTimeout(ctx, f.nodes[2].NS, "tcp", addr, dropWait)
			if err == nil {
				return fmt.Errorf("answered by %s", a.Backend)
			}
			if harness.KindOf(err) != harness.Timeout {
				return err
			}
			return nil
		})
		expectDropped(ctx, t, f.nodes[2].NS, addr)
	})

	t.Run("terminating endpoints: new connections avoid them, existing ones survive", func(t *testing.T) {
		s := harness.CreateService(ctx, t, f.c.Client, harness.NodePortService("term", harness.TCPPort("http", 80, echoPort)))
		harness.ApplySlice(ctx, t, f.c.Client, harness.Slice(s, f.ep(0, false)))
		addr := harness.NodePortAddr(f.nodes[2].IP, s, 0)
		waitAnswer(t, client, addr, "pod1")
		conn, err := client.DialContext(ctx, "tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		r := bufio.NewReader(conn)
		say := func() string {
			t.Helper()
			_ = conn.SetDeadline(time.Now().Add(3 * time.Second))
			if _, err := io.WriteString(conn, "ping\n"); err != nil {
				t.Fatalf("long-lived connection: write: %v", err)
			}
			line, err := r.ReadString('\n')
			if err != nil {
				t.Fatalf("long-lived connection: read: %v", err)
			}
			return strings.Fields(line)[0]
		}
		if b := say(); b != "pod1" {
			t.Fatalf("long-lived connection answered by %s, want pod1", b)
		}
		// pod1 terminates (still serving), pod2 is ready: new connections go to pod2 only.
		harness.ApplySlice(ctx, t, f.c.Client, harness.Slice(s, f.ep(0, true), f.ep(1, false)))
		waitAnswer(t, client, addr, "pod2")
		expectBackends(ctx, t, client, addr, 8, "pod2")
		if b := say(); b != "pod1" {
			t.Errorf("long-lived connection now answered by %s, want pod1", b)
		}
		// Only terminating endpoints left: new connections fall back to them.
		harness.ApplySlice(ctx, t, f.c.Client, harness.Slice(s, f.ep(0, true)))
		waitAnswer(t, client, addr, "pod1")
		expectBackends(ctx, t, client, addr, 4, "pod1")
		if b := say(); b != "pod1" {
			t.Errorf("long-lived connection now answered by %s, want pod1", b)
		}
	})

	t.Run("healthz, livez, proxyMode and metrics", func(t *testing.T) {
		node := f.nodes[0]
		for _, path := range []string{"/healthz", "/livez"} {
			code, body, err := httpGet(ctx, client, netip.Addr{}, netip.AddrPortFrom(node.IP, 10256).String(), path)
			if err != nil {
				t.Fatal(err)
			}
			if code != 200 || !strings.HasPrefix(body, `{"lastUpdated": "`) {
				t.Errorf("%s: %d %s", path, code, body)
			}
			if path == "/healthz" && !strings.HasSuffix(body, `, "nodeEligible": true}`) {
				t.Errorf("%s: body %s lacks nodeEligible", path, body)
			}
		}
		code, body, err := httpGet(ctx, node.NS, netip.Addr{}, "127.0.0.1:10249", "/proxyMode")
		if err != nil || code != 200 || body != "userspace" {
			t.Errorf("/proxyMode: %d %q %v", code, body, err)
		}
		code, body, err = httpGet(ctx, node.NS, netip.Addr{}, "127.0.0.1:10249", "/metrics")
		if err != nil || code != 200 {
			t.Fatalf("/metrics: %d %v", code, err)
		}
		fams, err := metricstest.Parse(strings.NewReader(body))
		if err != nil {
			t.Fatalf("/metrics: %v", err)
		}
		one := func(name string, labels map[string]string) float64 {
			t.Helper()
			v, ok := fams.Value(name, labels)
			if !ok {
				t.Errorf("%s%v missing", name, labels)
			}
			return v
		}
		if v := one("kubeproxy_sync_proxy_rules_last_timestamp_seconds", nil); v < float64(time.Now().Add(-time.Hour).Unix()) {
			t.Errorf("last sync timestamp %v", v)
		}
		if v := one("kubeproxy_sync_proxy_rules_duration_seconds", nil); v < 1 {
			t.Errorf("%v syncs observed", v)
		}
		if v := one("kubeproxy_sync_proxy_rules_service_changes_total", nil); v < 4 {
			t.Errorf("service changes %v, want ≥ 4 (four services created)", v)
		}
		if v := one("kubeproxy_sync_proxy_rules_endpoint_changes_total", nil); v < 4 {
			t.Errorf("endpoint changes %v, want ≥ 4", v)
		}
		if v := one("kubeproxy_network_programming_duration_seconds", nil); v < 1 {
			t.Errorf("network programming observations %v", v)
		}
		local := map[string]string{"namespace": "default", "service": "local", "port": "http", "protocol": "TCP"}
		// node1 served the Local service's NodePort and LB IP: ≥ 8 + 6 connections, all ended.
		if v := one("kube_userspace_proxy_connections_accepted_total", local); v < 14 {
			t.Errorf("connections accepted on node1 for default/local %v, want ≥ 14", v)
		}
		if v := one("kube_userspace_proxy_bytes_to_endpoints_total", local); v < 14*5 {
			t.Errorf("bytes to endpoints %v, want ≥ %d (\"ping\\n\" per connection)", v, 14*5)
		}
		// Each answer is the pod's name and the peer it saw ("pod1 10.244.…:port\n").
		if v, want := one("kube_userspace_proxy_bytes_from_endpoints_total", local), 14*len("pod1 1.2.3.4:5\n"); v < float64(want) {
			t.Errorf("bytes from endpoints %v, want ≥ %d", v, want)
		}
		if v := one("kube_userspace_proxy_connections_active", local); v != 0 {
			t.Errorf("active connections %v, want 0: every connection of the earlier cases has ended", v)
		}
		// Series appear with their first event: no failure, no series (or a zero one).
		if v, _ := fams.Value("kube_userspace_proxy_connections_failed_total", local); v != 0 {
			t.Errorf("failed connections %v, want 0: node1 always had its local endpoint", v)
		}
	})

	t.Run("a node tainted ToBeDeletedByClusterAutoscaler fails /healthz until untainted", func(t *testing.T) {
		node := f.nodes[1]
		addr := netip.AddrPortFrom(node.IP, 10256).String()
		taint := func(on bool) {
			t.Helper()
			n, err := f.c.Client.CoreV1().Nodes().Get(ctx, nodeName(1), metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			n.Spec.Taints = nil
			if on {
				n.Spec.Taints = []corev1.Taint{{Key: "ToBeDeletedByClusterAutoscaler", Value: "1700000000", Effect: corev1.TaintEffectNoSchedule}}
			}
			if _, err := f.c.Client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		expect := func(code int, suffix string) time.Duration {
			t.Helper()
			return harness.WaitFor(t, converge, func() error {
				c, b, err := httpGet(ctx, client, netip.Addr{}, addr, "/healthz")
				if err != nil {
					return err
				}
				if c != code || !strings.HasSuffix(b, suffix) {
					return fmt.Errorf("/healthz on %s: %d %s, want %d and a body ending in %s", nodeName(1), c, b, code, suffix)
				}
				return nil
			})
		}
		taint(true)
		t.Logf("tainted: /healthz 503 after %v", expect(503, `"nodeEligible": false}`).Round(time.Millisecond))
		if c, b, err := httpGet(ctx, client, netip.Addr{}, addr, "/livez"); err != nil || c != 200 {
			t.Errorf("/livez on the tainted node: %d %s %v, want 200", c, b, err)
		}
		taint(false)
		t.Logf("untainted: /healthz 200 after %v", expect(200, `"nodeEligible": true}`).Round(time.Millisecond))
	})
}
