//go:build cluster

package kcluster

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

const (
	proxyNS    = "kube-system"
	proxyName  = "kube-userspace-proxy"
	proxyLabel = "app.kubernetes.io/name=kube-userspace-proxy"
	echoNS     = "kup-e2e"
	// rolloutLimit bounds a DaemonSet rollout over the three nodes.
	rolloutLimit = 60 * time.Second
)

// deployProxy applies deploy/ through the cluster's overlay and waits for the DaemonSet's
// rollout; tests that need the proxy call it first (it is cheap once done).
var deployOnce struct {
	sync.Mutex
	done bool
}

func deployProxy(t *testing.T) {
	t.Helper()
	deployOnce.Lock()
	defer deployOnce.Unlock()
	if deployOnce.done {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := clusterSh(ctx, "deploy"); err != nil {
		t.Fatal(err)
	}
	kubectl(t, 3*time.Minute, "-n", proxyNS, "rollout", "status", "daemonset/"+proxyName, "--timeout=150s")
	// A rollout (a cluster kept from an earlier run) ends before the old pods are gone.
	waitFor(t, time.Minute, 500*time.Millisecond, "one proxy pod per node", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		pods, err := env.client.CoreV1().Pods(proxyNS).List(ctx, metav1.ListOptions{LabelSelector: proxyLabel})
		if err != nil {
			return err
		}
		if len(pods.Items) != len(nodes) {
			return fmt.Errorf("%d proxy pods", len(pods.Items))
		}
		return nil
	})
	deployOnce.done = true
}

// proxyPods returns the proxy's pods by node (failing if a node has more than one).
func proxyPods(t testing.TB) map[string]v1.Pod {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pods, err := env.client.CoreV1().Pods(proxyNS).List(ctx, metav1.ListOptions{LabelSelector: proxyLabel})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]v1.Pod{}
	for _, p := range pods.Items {
		if _, dup := out[p.Spec.NodeName]; dup {
			t.Fatalf("two proxy pods on %s: %s and %s", p.Spec.NodeName, out[p.Spec.NodeName].Name, p.Name)
		}
		out[p.Spec.NodeName] = p
	}
	return out
}

func podReady(p *v1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == v1.PodReady {
			return c.Status == v1.ConditionTrue
		}
	}
	return false
}

// natRules returns a node's nat table (nft and legacy iptables both: the proxy picks one).
func natRules(ctx context.Context, node string) (string, error) {
	out, err := onNode(ctx, node, "sh", "-c", "iptables-save -t nat; iptables-legacy-save -t nat 2>/dev/null; true")
	return out, err
}

// TestDaemonSetReady: deploy/ as applied by kubectl runs on all three nodes and is Ready; no
// other service proxy runs; every node's /healthz answers 200 to the client outside.
func TestDaemonSetReady(t *testing.T) {
	deployProxy(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ds, err := env.client.AppsV1().DaemonSets(proxyNS).Get(ctx, proxyName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if s := ds.Status; s.DesiredNumberScheduled != 3 || s.NumberReady != 3 || s.UpdatedNumberScheduled != 3 {
		t.Fatalf("DaemonSet status: desired %d ready %d updated %d, want 3 each", s.DesiredNumberScheduled, s.NumberReady, s.UpdatedNumberScheduled)
	}
	pods := proxyPods(t)
	for _, n := range nodes {
		p, ok := pods[n]
		if !ok || !podReady(&p) {
			t.Errorf("%s: no Ready proxy pod (%v)", n, p.Status.Phase)
		}
	}

	// No other service proxy: no kube-proxy pod anywhere, no kube-proxy chains on any node.
	all, err := env.client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range all.Items {
		for _, c := range p.Spec.Containers {
			if strings.Contains(c.Image, "kube-proxy") || strings.Contains(p.Name, "kube-proxy") {
				t.Errorf("another service proxy runs: pod %s/%s image %s", p.Namespace, p.Name, c.Image)
			}
		}
	}
	for _, n := range nodes {
		rules, err := natRules(ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(rules, ":KUBE-SERVICES") {
			t.Errorf("%s: kube-proxy's KUBE-SERVICES chain exists", n)
		}
		if !strings.Contains(rules, ":KUBE-PORTALS-CONTAINER") {
			t.Errorf("%s: no KUBE-PORTALS-CONTAINER chain: the proxy has not programmed the node", n)
		}
		code, body, err := where("client").httpGet("http://" + net.JoinHostPort(nodeIP(n), "10256") + "/healthz")
		if err != nil || code != 200 {
			t.Errorf("%s: /healthz from the client: %d %s %v", n, code, body, err)
		}
	}
}

// workload is the kup-echo Deployment and its services, made once.
var wl struct {
	sync.Mutex
	done                    bool
	clusterIP               string // ClusterIP:80
	nodePort, localNodePort int
	healthCheckNodePort     int
}

const echoYAML = `
apiVersion: v1
kind: Namespace
metadata: {name: kup-e2e}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: echo, namespace: kup-e2e}
spec:
  replicas: 3
  selector: {matchLabels: {app: echo}}
  template:
    metadata: {labels: {app: echo}}
    spec:
      terminationGracePeriodSeconds: 10
      topologySpreadConstraints:
      - {maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: DoNotSchedule, nodeTaintsPolicy: Honor, labelSelector: {matchLabels: {app: echo}}}
      containers:
      - name: echo
        image: kup-echo:dev
        imagePullPolicy: Never
        args: [serve, --name, $(POD_NAME), --listen, "0.0.0.0:8080"]
        env:
        - name: POD_NAME
          valueFrom: {fieldRef: {fieldPath: metadata.name}}
        readinessProbe:
          tcpSocket: {port: 8080}
          periodSeconds: 1
        # Serve on while the endpoint's removal reaches every node (as any Deployment behind a
        # service proxy should).
        lifecycle:
          preStop:
            sleep: {seconds: 3}
---
apiVersion: v1
kind: Service
metadata: {name: echo, namespace: kup-e2e}
spec:
  selector: {app: echo}
  ports: [{name: tcp, port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: echo-np, namespace: kup-e2e}
spec:
  type: NodePort
  selector: {app: echo}
  ports: [{name: tcp, port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: echo-lb, namespace: kup-e2e}
spec:
  type: LoadBalancer
  selector: {app: echo}
  ports: [{name: tcp, port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: echo-local, namespace: kup-e2e}
spec:
  type: LoadBalancer
  externalTrafficPolicy: Local
  selector: {app: echo}
  ports: [{name: tcp, port: 80, targetPort: 8080}]
`

// workload applies the kup-echo Deployment (3 replicas, one per node) and its services, sets the
// load balancers' IPs through the Service status (as a cloud's controller would), and waits
// until every node's proxy answers for them.
func workload(t *testing.T) {
	t.Helper()
	deployProxy(t)
	wl.Lock()
	defer wl.Unlock()
	if wl.done {
		return
	}
	kubectlApply(t, echoYAML)
	kubectl(t, 2*time.Minute, "-n", echoNS, "rollout", "status", "deployment/echo", "--timeout=100s")
	if byNode := echoPods(t); len(byNode) != len(nodes) || count(byNode) != len(nodes) {
		// A cluster kept from an earlier run (a drain moved a pod): start the pods afresh, which
		// the topology spread puts one on each node.
		kubectl(t, time.Minute, "-n", echoNS, "scale", "deployment/echo", "--replicas=0")
		waitFor(t, time.Minute, 500*time.Millisecond, "no echo pod", func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			pods, err := env.client.CoreV1().Pods(echoNS).List(ctx, metav1.ListOptions{LabelSelector: "app=echo"})
			if err != nil {
				return err
			}
			if len(pods.Items) > 0 {
				return fmt.Errorf("%d echo pods", len(pods.Items))
			}
			return nil
		})
		kubectl(t, time.Minute, "-n", echoNS, "scale", "deployment/echo", "--replicas=3")
		kubectl(t, 2*time.Minute, "-n", echoNS, "rollout", "status", "deployment/echo", "--timeout=100s")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	svcs := env.client.CoreV1().Services(echoNS)
	for name, ip := range map[string]string{"echo-lb": lbIP, "echo-local": lbLocal} {
		patch := fmt.Sprintf(`{"status":{"loadBalancer":{"ingress":[{"ip":%q}]}}}`, ip)
		if _, err := svcs.Patch(ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}, "status"); err != nil {
			t.Fatalf("set %s's load-balancer IP: %v", name, err)
		}
	}
	get := func(name string) *v1.Service {
		s, err := svcs.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	wl.clusterIP = net.JoinHostPort(get("echo").Spec.ClusterIP, "80")
	wl.nodePort = int(get("echo-np").Spec.Ports[0].NodePort)
	local := get("echo-local")
	wl.localNodePort = int(local.Spec.Ports[0].NodePort)
	wl.healthCheckNodePort = int(local.Spec.HealthCheckNodePort)
	if wl.healthCheckNodePort == 0 {
		t.Fatal("echo-local: no healthCheckNodePort allocated")
	}
	// Every node's proxy has the services and all three endpoints once every backend answers
	// the client through each node (the EndpointSlice controller and the proxies follow the
	// pods' readiness a moment after the rollout's end).
	backends := echoPods(t)
	waitStart := time.Now()
	for _, n := range nodes {
		addr := net.JoinHostPort(nodeIP(n), strconv.Itoa(wl.nodePort))
		waitFor(t, 30*time.Second, 200*time.Millisecond, "every backend through the NodePort of "+n, func() error {
			got := map[string]bool{}
			for range 12 {
				name, _, err := where("client").ask(addr, 2*time.Second)
				if err != nil {
					return err
				}
				got[name] = true
			}
			for _, names := range backends {
				for _, name := range names {
					if !got[name] {
						return fmt.Errorf("%s did not answer (answers from %v)", name, got)
					}
				}
			}
			return nil
		})
	}
	// The load-balancer IPs were set a moment ago: node-1 (where the client routes them) has
	// them once they answer.
	for _, addr := range []string{net.JoinHostPort(lbIP, "80"), net.JoinHostPort(lbLocal, "80")} {
		waitFor(t, 30*time.Second, 200*time.Millisecond, "the load-balancer IP "+addr, func() error {
			_, _, err := where("client").ask(addr, 2*time.Second)
			return err
		})
	}
	t.Logf("every backend answered through every node, and the load-balancer IPs, %v after the Deployment's rollout", time.Since(waitStart).Round(10*time.Millisecond))
	wl.done = true
}

// echoPods returns the Ready kup-echo pods' names by node.
func echoPods(t testing.TB) map[string][]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pods, err := env.client.CoreV1().Pods(echoNS).List(ctx, metav1.ListOptions{LabelSelector: "app=echo"})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil && podReady(&p) {
			out[p.Spec.NodeName] = append(out[p.Spec.NodeName], p.Name)
		}
	}
	return out
}

func keys(m map[string]int) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// wantAll checks that the answers came from exactly the given backends.
func wantAll(t *testing.T, what string, got map[string]int, backends map[string][]string) {
	t.Helper()
	var want []string
	for _, names := range backends {
		want = append(want, names...)
	}
	sort.Strings(want)
	if g := keys(got); strings.Join(g, " ") != strings.Join(want, " ") {
		t.Errorf("%s: answered by %v (%v), want every backend %v", what, g, got, want)
	}
}

// TestServices: ClusterIP, NodePort and LoadBalancer services answer from a pod on another node,
// from a node and from the client outside, with every backend taking part; Local keeps the
// client's address and answers from the node's own endpoint; healthCheckNodePort reports it.
func TestServices(t *testing.T) {
	workload(t)
	backends := echoPods(t)
	if len(backends) != 3 {
		t.Fatalf("kup-echo pods by node: %v, want one on each of the three", backends)
	}
	const n = 30 // round robin over 3 backends

	t.Run("ClusterIP from a pod on another node", func(t *testing.T) {
		pod := backends["node-1"][0]
		out := kubectl(t, time.Minute, "-n", echoNS, "exec", pod, "--", "/kup-echo", "request", "--tcp", wl.clusterIP, "--count", strconv.Itoa(n))
		got := map[string]int{}
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(line)
			if len(f) == 2 {
				got[f[0]]++
			}
		}
		wantAll(t, "ClusterIP from pod "+pod, got, backends)
	})
	t.Run("ClusterIP from a node", func(t *testing.T) {
		wantAll(t, "ClusterIP from node-2", where("node-2").answers(t, wl.clusterIP, n), backends)
	})
	t.Run("NodePort from a node", func(t *testing.T) {
		addr := net.JoinHostPort(nodeIP("node-3"), strconv.Itoa(wl.nodePort))
		wantAll(t, "NodePort of node-3 from node-2", where("node-2").answers(t, addr, n), backends)
	})
	t.Run("NodePort from the client", func(t *testing.T) {
		for _, node := range nodes {
			addr := net.JoinHostPort(nodeIP(node), strconv.Itoa(wl.nodePort))
			wantAll(t, "NodePort of "+node+" from the client", where("client").answers(t, addr, n), backends)
		}
	})
	t.Run("LoadBalancer from the client", func(t *testing.T) {
		wantAll(t, "LB IP from the client", where("client").answers(t, net.JoinHostPort(lbIP, "80"), n), backends)
	})
	t.Run("LoadBalancer from a node", func(t *testing.T) {
		wantAll(t, "LB IP from node-3", where("node-3").answers(t, net.JoinHostPort(lbIP, "80"), n), backends)
	})
	t.Run("Local keeps the client's address", func(t *testing.T) {
		check := func(what, addr string, node string) {
			for range 10 {
				name, peer, err := where("client").ask(addr, 5*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				if !contains(backends[node], name) {
					t.Errorf("%s: answered by %s, want %s's own %v", what, name, node, backends[node])
				}
				if host, _, _ := net.SplitHostPort(peer); host != clientIP {
					t.Errorf("%s: the backend saw %s, want the client's %s", what, peer, clientIP)
				}
			}
		}
		// The client routes load-balancer IPs to node-1.
		check("Local LB IP", net.JoinHostPort(lbLocal, "80"), "node-1")
		check("Local NodePort of node-2", net.JoinHostPort(nodeIP("node-2"), strconv.Itoa(wl.localNodePort)), "node-2")
	})
	t.Run("healthCheckNodePort", func(t *testing.T) {
		for _, node := range nodes {
			url := "http://" + net.JoinHostPort(nodeIP(node), strconv.Itoa(wl.healthCheckNodePort)) + "/"
			code, body, err := where("client").httpGet(url)
			if err != nil {
				t.Fatal(err)
			}
			var h struct{ LocalEndpoints int }
			if jerr := json.Unmarshal([]byte(body), &h); code != 200 || jerr != nil || h.LocalEndpoints != len(backends[node]) {
				t.Errorf("%s: %s: %d %s, want 200 with localEndpoints %d", node, url, code, body, len(backends[node]))
			}
		}
	})
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// TestScaleAndDeleteUnderLoad: scaling the Deployment down and deleting a pod under 100
// requests per second from the client loses none (the real controller's terminating endpoints).
func TestScaleAndDeleteUnderLoad(t *testing.T) {
	workload(t)
	addr := net.JoinHostPort(nodeIP("node-2"), strconv.Itoa(wl.nodePort))
	l := startLoad("client", addr, 100)
	stopped := false
	defer func() {
		if !stopped {
			l.finish()
		}
	}()
	time.Sleep(2 * time.Second)

	kubectl(t, time.Minute, "-n", echoNS, "scale", "deployment/echo", "--replicas=2")
	waitFor(t, time.Minute, 500*time.Millisecond, "two echo pods", func() error {
		if got := echoPods(t); count(got) != 2 {
			return fmt.Errorf("pods %v", got)
		}
		return nil
	})
	time.Sleep(5 * time.Second) // the removed pod's termination and its endpoint's removal
	var victim string
	for _, names := range echoPods(t) {
		victim = names[0]
		break
	}
	kubectl(t, time.Minute, "-n", echoNS, "delete", "pod", victim, "--wait=true", "--timeout=50s")
	kubectl(t, 2*time.Minute, "-n", echoNS, "rollout", "status", "deployment/echo", "--timeout=100s")
	kubectl(t, time.Minute, "-n", echoNS, "scale", "deployment/echo", "--replicas=3")
	kubectl(t, 2*time.Minute, "-n", echoNS, "rollout", "status", "deployment/echo", "--timeout=100s")
	time.Sleep(3 * time.Second)

	ok, fails := l.finish()
	stopped = true
	t.Logf("%d requests answered, %d failed", ok, len(fails))
	if len(fails) > 0 {
		t.Errorf("%d of %d requests failed during scale-down and pod deletion; first: %v", len(fails), int(ok)+len(fails), fails[:min(len(fails), 5)])
	}
	if ok < 1000 {
		t.Errorf("only %d requests answered: the load did not run", ok)
	}
}

func count(m map[string][]string) int {
	n := 0
	for _, v := range m {
		n += len(v)
	}
	return n
}

// TestProxyRollout: `kubectl rollout restart` of the DaemonSet, then a change of its image, then
// new proxies that start seconds late, each under traffic with one long TCP stream open: the
// stream survives (checksummed both ways), no new connection fails, the rollout completes on
// every node within rolloutLimit and no old pod is left.
func TestProxyRollout(t *testing.T) {
	workload(t)
	t.Run("restart", func(t *testing.T) {
		underTraffic(t, func() {
			kubectl(t, 30*time.Second, "-n", proxyNS, "rollout", "restart", "daemonset/"+proxyName)
		})
	})
	t.Run("image", func(t *testing.T) {
		// The same image under a second name, in every node's containerd.
		const image = "kube-userspace-proxy:dev-retag"
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if out, err := exec.CommandContext(ctx, "docker", "tag", "kube-userspace-proxy:dev", image).CombinedOutput(); err != nil {
			t.Fatalf("docker tag: %v: %s", err, out)
		}
		for _, n := range nodes {
			sock := filepath.Join(env.state, n, "containerd.sock")
			cmd := fmt.Sprintf("docker save %s | ctr -a %s -n k8s.io images import -", image, sock)
			if out, err := exec.CommandContext(ctx, "sh", "-c", cmd).CombinedOutput(); err != nil {
				t.Fatalf("import %s into %s: %v: %s", image, n, err, out)
			}
		}
		underTraffic(t, func() {
			kubectl(t, 30*time.Second, "-n", proxyNS, "set", "image", "daemonset/"+proxyName, proxyName+"="+image)
		})
	})
	t.Run("slow start", func(t *testing.T) {
		// New proxies that need seconds before they can take over (informers of a large
		// cluster, a slow API server): here a shell sleeps before the same command. The new pod
		// must not turn Ready, and the old one must not be stopped, before the hand-over; a
		// readiness probe that the old process answers, or a fixed delay before its SIGTERM
		// shorter than the sleep, refuses connections here.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		ds, err := env.client.AppsV1().DaemonSets(proxyNS).Get(ctx, proxyName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		orig := ds.Spec.Template.Spec.Containers[0].Command
		slow := append([]string{"/bin/sh", "-c", `sleep 6; exec "$0" "$@"`}, orig...)
		setCommand := func(cmd []string) {
			patch, err := json.Marshal([]map[string]any{{"op": "replace", "path": "/spec/template/spec/containers/0/command", "value": cmd}})
			if err != nil {
				t.Fatal(err)
			}
			kubectl(t, 30*time.Second, "-n", proxyNS, "patch", "daemonset/"+proxyName, "--type=json", "-p", string(patch))
		}
		underTraffic(t, func() { setCommand(slow) })
		underTraffic(t, func() { setCommand(orig) })
	})
}

// underTraffic runs change (which starts a DaemonSet rollout) with a long stream from the
// client to the LB IP and 50 new connections per second to a NodePort, and checks the rollout.
func underTraffic(t *testing.T, change func()) {
	t.Helper()
	before := proxyPods(t)
	s := startStream(t, "client", net.JoinHostPort(lbIP, "80"), 20*time.Millisecond)
	l := startLoad("client", net.JoinHostPort(nodeIP("node-3"), strconv.Itoa(wl.nodePort)), 50)
	finished := false
	defer func() {
		if !finished {
			l.finish()
			s.finish()
		}
	}()
	time.Sleep(time.Second)

	start := time.Now()
	change()
	kubectl(t, rolloutLimit+30*time.Second, "-n", proxyNS, "rollout", "status", "daemonset/"+proxyName,
		"--timeout="+rolloutLimit.String())
	took := time.Since(start)
	// No old pod left (the old pods wait for their deletion after handing over).
	waitFor(t, 30*time.Second, 500*time.Millisecond, "old proxy pods gone", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		pods, err := env.client.CoreV1().Pods(proxyNS).List(ctx, metav1.ListOptions{LabelSelector: proxyLabel})
		if err != nil {
			return err
		}
		if len(pods.Items) != 3 {
			return fmt.Errorf("%d proxy pods", len(pods.Items))
		}
		for _, p := range pods.Items {
			if old, ok := before[p.Spec.NodeName]; ok && old.UID == p.UID {
				return fmt.Errorf("%s's old pod %s is still there", p.Spec.NodeName, p.Name)
			}
			if !podReady(&p) {
				return fmt.Errorf("%s not Ready", p.Name)
			}
		}
		return nil
	})
	t.Logf("rollout on 3 nodes took %v", took.Round(100*time.Millisecond))
	if took > rolloutLimit {
		t.Errorf("rollout took %v, over %v", took, rolloutLimit)
	}
	time.Sleep(2 * time.Second)
	finished = true
	ok, fails := l.finish()
	if err := s.finish(); err != nil {
		t.Errorf("the long stream did not survive the rollout: %v", err)
	}
	t.Logf("new connections: %d answered, %d failed; stream: %d lines both ways", ok, len(fails), s.sent.Load())
	if len(fails) > 0 {
		t.Errorf("%d new connections failed during the rollout; first: %v", len(fails), fails[:min(len(fails), 5)])
	}
}

// TestProxyKilled: SIGKILL of the proxy's container on node-2: the kubelet restarts it, the
// service's rules stay in place throughout, and traffic resumes within a second of the new
// container's start.
func TestProxyKilled(t *testing.T) {
	workload(t)
	const node = "node-2"
	pod := proxyPods(t)[node]
	if len(pod.Status.ContainerStatuses) != 1 {
		t.Fatalf("proxy pod %s: container statuses %v", pod.Name, pod.Status.ContainerStatuses)
	}
	cs := pod.Status.ContainerStatuses[0]
	id := strings.TrimPrefix(cs.ContainerID, "containerd://")
	clusterIP, _, _ := net.SplitHostPort(wl.clusterIP)

	// The rules: the service's portal must be in node-2's nat table at every look.
	stopRules := make(chan struct{})
	rulesDone := make(chan []string)
	go func() {
		var missing []string
		looks := 0
		for {
			select {
			case <-stopRules:
				if looks < 10 {
					missing = append(missing, fmt.Sprintf("only %d looks at the rules", looks))
				}
				rulesDone <- missing
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			rules, err := natRules(ctx, node)
			cancel()
			looks++
			if err != nil || !strings.Contains(rules, clusterIP+"/32") {
				missing = append(missing, fmt.Sprintf("%s: no rule for %s (%v)", time.Now().Format("15:04:05.000"), clusterIP, err))
			}
		}
	}()

	// Traffic: one request at a time from node-2 to the ClusterIP, each noted.
	type result struct {
		at time.Time
		ok bool
	}
	var results []result
	stopTraffic := make(chan struct{})
	trafficDone := make(chan struct{})
	go func() {
		defer close(trafficDone)
		for {
			select {
			case <-stopTraffic:
				return
			default:
			}
			_, _, err := where(node).ask(wl.clusterIP, 500*time.Millisecond)
			results = append(results, result{time.Now(), err == nil})
			if err != nil {
				time.Sleep(10 * time.Millisecond)
			}
		}
	}()
	time.Sleep(time.Second)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	killed := time.Now()
	sock := filepath.Join(env.state, node, "containerd.sock")
	if _, err := onNode(ctx, node, "ctr", "-a", sock, "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", id); err != nil {
		t.Fatal(err)
	}
	var (
		started  time.Time
		restarts int32
	)
	waitFor(t, time.Minute, 200*time.Millisecond, "the kubelet restarts the proxy", func() error {
		p, err := env.client.CoreV1().Pods(proxyNS).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		c := p.Status.ContainerStatuses[0]
		if c.RestartCount <= cs.RestartCount || c.State.Running == nil || !podReady(p) {
			return fmt.Errorf("restarts %d, state %+v", c.RestartCount, c.State)
		}
		started, restarts = c.State.Running.StartedAt.Time, c.RestartCount
		return nil
	})
	time.Sleep(2 * time.Second)
	close(stopTraffic)
	<-trafficDone
	close(stopRules)
	if missing := <-rulesDone; len(missing) > 0 {
		t.Errorf("the service's rules were not there at %d looks: %v", len(missing), missing[:min(len(missing), 5)])
	}

	// The outage: from the first failure after the kill to the first success after the last one.
	var firstFail, resumed time.Time
	for i, r := range results {
		if r.at.Before(killed) {
			continue
		}
		if !r.ok {
			if firstFail.IsZero() {
				firstFail = r.at
			}
			resumed = time.Time{}
			for _, s := range results[i+1:] {
				if s.ok {
					resumed = s.at
					break
				}
			}
		}
	}
	if firstFail.IsZero() {
		t.Logf("no request failed after the kill")
		return
	}
	if resumed.IsZero() {
		t.Fatalf("traffic did not resume after the kill at %s", killed.Format("15:04:05.000"))
	}
	// The new process's start, to the nanosecond: its first log line as the kubelet wrote it
	// (StartedAt has whole seconds only).
	begun := started
	logFile := filepath.Join(env.state, node, "var", "log", "pods",
		fmt.Sprintf("%s_%s_%s", proxyNS, pod.Name, pod.UID), proxyName, fmt.Sprintf("%d.log", restarts))
	if data, err := os.ReadFile(logFile); err != nil {
		t.Errorf("the restarted proxy's log: %v", err)
	} else if ts, err := time.Parse(time.RFC3339Nano, strings.SplitN(string(data), " ", 2)[0]); err != nil {
		t.Errorf("the restarted proxy's log %s: no timestamp on the first line: %v", logFile, err)
	} else {
		begun = ts
	}
	t.Logf("killed %s, first failure +%v, the kubelet started the new proxy +%v, traffic resumed +%v after the kill, %v after the new proxy's start",
		killed.Format("15:04:05.000"), firstFail.Sub(killed).Round(time.Millisecond), begun.Sub(killed).Round(time.Millisecond),
		resumed.Sub(killed).Round(time.Millisecond), resumed.Sub(begun).Round(time.Millisecond))
	if resumed.Sub(begun) > time.Second {
		t.Errorf("traffic resumed %v after the restarted proxy's start: want within 1 s", resumed.Sub(begun).Round(time.Millisecond))
	}
}

// TestDrain: kube-proxy's /healthz turns nodeEligible false when the node is about to go (the
// cluster autoscaler's ToBeDeletedByClusterAutoscaler taint, put before it drains; or deletion),
// and not for a cordon or drain alone. Drain node-3 as the autoscaler does: taint, then drain.
func TestDrain(t *testing.T) {
	workload(t)
	const node = "node-3"
	url := "http://" + net.JoinHostPort(nodeIP(node), "10256") + "/healthz"
	eligible := func() (bool, int, error) {
		code, body, err := where("client").httpGet(url)
		if err != nil {
			return false, 0, err
		}
		var h struct{ NodeEligible *bool }
		if err := json.Unmarshal([]byte(body), &h); err != nil || h.NodeEligible == nil {
			return false, code, fmt.Errorf("%s: %d %q: no nodeEligible (%v)", url, code, body, err)
		}
		return *h.NodeEligible, code, nil
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_, _ = run(ctx, nil, env.kubectl, "taint", "node", node, "ToBeDeletedByClusterAutoscaler-") // absent unless a step failed
		if _, err := run(ctx, nil, env.kubectl, "uncordon", node); err != nil {
			t.Error(err)
		}
	}()

	kubectl(t, 2*time.Minute, "drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=90s")
	time.Sleep(3 * time.Second)
	if e, code, err := eligible(); err != nil || !e || code != 200 {
		t.Errorf("after a plain drain: nodeEligible %v (%d, %v), want true and 200 as kube-proxy's", e, code, err)
	}
	// The drain evicted node-3's kup-echo pod: the Local service's health check there says so.
	hc := "http://" + net.JoinHostPort(nodeIP(node), strconv.Itoa(wl.healthCheckNodePort)) + "/"
	waitFor(t, 20*time.Second, 200*time.Millisecond, node+"'s healthCheckNodePort without a local endpoint", func() error {
		code, body, err := where("client").httpGet(hc)
		if err != nil {
			return err
		}
		var h struct{ LocalEndpoints *int }
		if err := json.Unmarshal([]byte(body), &h); err != nil || h.LocalEndpoints == nil || *h.LocalEndpoints != 0 || code != 503 {
			return fmt.Errorf("%s: %d %s, want 503 with localEndpoints 0", hc, code, body)
		}
		return nil
	})
	kubectl(t, time.Minute, "taint", "node", node, "ToBeDeletedByClusterAutoscaler="+strconv.FormatInt(time.Now().Unix(), 10)+":NoSchedule")
	waitFor(t, 20*time.Second, 200*time.Millisecond, node+"'s /healthz turning nodeEligible false", func() error {
		e, code, err := eligible()
		if err != nil {
			return err
		}
		if e || code != 503 {
			return fmt.Errorf("nodeEligible %v, status %d", e, code)
		}
		return nil
	})
	kubectl(t, time.Minute, "taint", "node", node, "ToBeDeletedByClusterAutoscaler-")
	waitFor(t, 20*time.Second, 200*time.Millisecond, node+"'s /healthz back to nodeEligible true", func() error {
		e, code, err := eligible()
		if err != nil {
			return err
		}
		if !e || code != 200 {
			return fmt.Errorf("nodeEligible %v, status %d", e, code)
		}
		return nil
	})
}
