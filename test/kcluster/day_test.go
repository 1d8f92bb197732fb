//go:build cluster

package kcluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// A node's day under traffic (make test-cluster; bench/cluster-day.sh runs them per service
// proxy): scale-downs, pod deletions, a drain, a node's restart, the API server's restart and a
// SIGKILL of the service proxy, each while a client outside the cluster opens 50 new connections
// a second through a NodePort, each with a 0.5 s timeout. Every connection must be answered: a
// service proxy that dials the endpoints itself hides those that die.

const (
	dayNS   = "kup-day"
	dayRate = 50                     // new connections per second
	dayWait = 500 * time.Millisecond // the client's patience
)

// dayYAML is a Deployment as a user writes one: kup-echo behind a NodePort Service, a readiness
// probe, spread over the nodes, and no preStop hook: its pods stop listening as soon as they are
// told to stop (SIGTERM), and answer the connections they had accepted, as servers do.
const dayYAML = `
apiVersion: v1
kind: Namespace
metadata: {name: kup-day}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: day, namespace: kup-day}
spec:
  replicas: 3
  selector: {matchLabels: {app: day}}
  template:
    metadata: {labels: {app: day}}
    spec:
      terminationGracePeriodSeconds: 10
      topologySpreadConstraints:
      - {maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: ScheduleAnyway, labelSelector: {matchLabels: {app: day}}}
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
---
apiVersion: v1
kind: Service
metadata: {name: day, namespace: kup-day}
spec:
  type: NodePort
  selector: {app: day}
  ports: [{name: tcp, port: 80, targetPort: 8080}]
`

// The same scenarios measure other service proxies (bench/cluster-day.sh): KUP_DAY_PROXY names the
// one the cluster runs (hack/cluster.sh proxy NAME; empty: ours, deployed by the tests),
// KUP_DAY_REPORT a file that gets a JSON line of figures per scenario, and KUP_DAY_MEASURE=1
// reports failed connections without failing the test.
func dayProxy() string {
	if p := os.Getenv("KUP_DAY_PROXY"); p != "" {
		return p
	}
	return proxyName
}

// record appends r's figures to KUP_DAY_REPORT, if set: a line of tab-separated fields, the
// proxy, the scenario, connections, failed connections, the failures by kind, and each failure's
// time after the scenario's last mark with its kind.
func (r probeResult) record(t testing.TB, scenario string) {
	t.Helper()
	file := os.Getenv("KUP_DAY_REPORT")
	if file == "" {
		return
	}
	var each []string
	for _, f := range r.failures {
		each = append(each, r.since(f.at)+": "+f.kind)
	}
	line := strings.Join([]string{dayProxy(), scenario, strconv.Itoa(r.total()), strconv.Itoa(len(r.failures)),
		r.kinds(), strings.Join(each, "; ")}, "\t") + "\n"
	out, err := os.OpenFile(file, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if _, err := out.WriteString(line); err != nil {
		t.Fatal(err)
	}
}

// dayNodePort applies the day workload (once) and returns its NodePort.
func dayNodePort(t *testing.T) int {
	t.Helper()
	if dayProxy() == proxyName {
		deployProxy(t)
	}
	kubectlApply(t, dayYAML)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	svc, err := env.client.CoreV1().Services(dayNS).Get(ctx, "day", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return int(svc.Spec.Ports[0].NodePort)
}

// dayScale scales the day Deployment to n and waits until n pods are Ready, the EndpointSlices
// list exactly those n as ready (and nothing terminating), and every one of them answers through
// the NodePort of node-1.
func dayScale(t *testing.T, n int) {
	t.Helper()
	port := dayNodePort(t)
	kubectl(t, time.Minute, "-n", dayNS, "scale", "deployment/day", fmt.Sprintf("--replicas=%d", n))
	kubectl(t, 4*time.Minute, "-n", dayNS, "rollout", "status", "deployment/day", "--timeout=200s")
	waitFor(t, 2*time.Minute, 200*time.Millisecond, fmt.Sprintf("%d ready endpoints and no other", n), func() error {
		ready, other := dayEndpoints(t)
		if ready != n || other != 0 {
			return fmt.Errorf("%d ready endpoints, %d others", ready, other)
		}
		return nil
	})
	addr := dialAddr(nodeIP("node-1"), port)
	waitFor(t, 30*time.Second, 200*time.Millisecond, fmt.Sprintf("%d backends through %s", n, addr), func() error {
		seen := map[string]bool{}
		for range 4 * n {
			name, _, err := where("client").ask(addr, 2*time.Second)
			if err != nil {
				return err
			}
			seen[name] = true
		}
		if len(seen) != n {
			return fmt.Errorf("answers from %d backends", len(seen))
		}
		return nil
	})
}

// dayEndpoints counts the day Service's endpoints: ready ones and the others (terminating, not
// ready).
func dayEndpoints(t testing.TB) (ready, other int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	slices, err := env.client.DiscoveryV1().EndpointSlices(dayNS).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=day"})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range slices.Items {
		for _, e := range s.Endpoints {
			if e.Conditions.Ready != nil && *e.Conditions.Ready {
				ready++
			} else {
				other++
			}
		}
	}
	return ready, other
}

// dayPods returns the day pods (not being deleted) by node.
func dayPods(t testing.TB) map[string][]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pods, err := env.client.CoreV1().Pods(dayNS).List(ctx, metav1.ListOptions{LabelSelector: "app=day"})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil {
			out[p.Spec.NodeName] = append(out[p.Spec.NodeName], p.Name)
		}
	}
	return out
}

// dayTraffic runs scenario under the day traffic through node-1's NodePort, after 2 s of the
// same traffic undisturbed, and fails the test for every failed connection, saying what each saw
// and when. Failures before the scenario's first step are the machine's, not the scenario's (a
// cluster on a machine too busy to answer within the client's timeout): they fail the test on
// their own count.
func dayTraffic(t *testing.T, what string, scenario func(p *probe)) probeResult {
	t.Helper()
	return dayTrafficTolerating(t, what, nil, scenario)
}

// dayTrafficTolerating is dayTraffic where the scenario's failures for which tolerated reports
// true are reported (and recorded) but do not fail the test.
func dayTrafficTolerating(t *testing.T, what string, tolerated func(failure) bool, scenario func(p *probe)) probeResult {
	t.Helper()
	port := dayNodePort(t)
	p := startProbe("client", dialAddr(nodeIP("node-1"), port), dayRate, dayWait)
	finished := false
	defer func() {
		if !finished {
			p.finish()
		}
	}()
	time.Sleep(2 * time.Second)
	scenario(p)
	finished = true
	all := p.finish()
	quiet, r := all.split()
	quiet.report(t, what+", undisturbed before")
	r.report(t, what)
	quiet.record(t, "undisturbed")
	r.record(t, what)
	measure := os.Getenv("KUP_DAY_MEASURE") != ""
	if len(quiet.failures) > 0 && !measure {
		t.Errorf("%s: %d of %d connections failed before the scenario began: the cluster does not serve %d connections/s within %v even undisturbed (a busy machine?)",
			what, len(quiet.failures), quiet.total(), dayRate, dayWait)
	}
	failed := 0
	for _, f := range r.failures {
		if tolerated == nil || !tolerated(f) {
			failed++
		}
	}
	if failed > 0 && !measure {
		t.Errorf("%s: %d of %d connections failed (%s)", what, failed, r.total(), r.kinds())
	}
	if least := int(all.took.Seconds()) * dayRate / 2; all.total() < least {
		t.Errorf("%s: only %d connections in %v: the probe did not run", what, all.total(), all.took.Round(time.Second))
	}
	return r
}

// settle waits for d while the traffic runs on.
func settle(d time.Duration) { time.Sleep(d) }

// TestDayScaleDown: scale 10 → 1 under traffic, twice.
func TestDayScaleDown(t *testing.T) {
	for i := range 2 {
		dayScale(t, 10)
		t.Logf("scale-down %d of 2", i+1)
		dayTraffic(t, "scale 10 → 1", func(p *probe) {
			p.mark("scale 10 → 1")
			kubectl(t, time.Minute, "-n", dayNS, "scale", "deployment/day", "--replicas=1")
			waitFor(t, time.Minute, 200*time.Millisecond, "the nine pods gone", func() error {
				if n := count(dayPods(t)); n != 1 {
					return fmt.Errorf("%d pods", n)
				}
				return nil
			})
			settle(3 * time.Second)
		})
	}
}

// TestDayPodDeletion: pods deleted under traffic, one, then two at once.
func TestDayPodDeletion(t *testing.T) {
	dayScale(t, 3)
	dayTraffic(t, "pod deletions", func(p *probe) {
		for _, n := range []int{1, 2} {
			var victims []string
			for _, names := range dayPods(t) {
				if len(victims) < n {
					victims = append(victims, names[0])
				}
			}
			p.mark("delete " + strings.Join(victims, " "))
			kubectl(t, time.Minute, append([]string{"-n", dayNS, "delete", "pod", "--wait=true", "--timeout=50s"}, victims...)...)
			kubectl(t, 2*time.Minute, "-n", dayNS, "rollout", "status", "deployment/day", "--timeout=100s")
			settle(2 * time.Second)
		}
	})
}

// TestDayDrain: `kubectl drain` of node-3 under traffic (its day pod evicted and started
// elsewhere), then uncordon.
func TestDayDrain(t *testing.T) {
	const node = "node-3"
	dayScale(t, 3)
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := run(ctx, nil, "kubectl", "uncordon", node); err != nil {
			t.Error(err)
		}
	}()
	dayTraffic(t, "drain of "+node, func(p *probe) {
		p.mark("drain " + node)
		kubectl(t, 2*time.Minute, "drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=90s")
		p.mark("drained " + node)
		kubectl(t, 2*time.Minute, "-n", dayNS, "rollout", "status", "deployment/day", "--timeout=100s")
		settle(2 * time.Second)
		kubectl(t, time.Minute, "uncordon", node)
		p.mark("uncordoned " + node)
		settle(time.Second)
	})
}

// TestDayNodeRestart: a node with a day pod, node-3 or else node-2, goes off (its kubelet,
// containerd and pods SIGKILLed; its endpoints stay listed as ready until the kubelet is back and
// says otherwise) and boots again, under traffic through node-1.
func TestDayNodeRestart(t *testing.T) {
	dayScale(t, 3)
	node := "node-3"
	if pods := dayPods(t); len(pods[node]) == 0 {
		node = "node-2"
		if len(pods[node]) == 0 {
			t.Fatalf("no day pod on node-3 or node-2: %v", pods)
		}
	}
	// Connections relayed to a pod of the node when its processes are killed are reset or
	// closed by its kernel, as with any service proxy: tolerated when they began before the stop
	// was done.
	var stopped time.Time
	inFlight := func(f failure) bool {
		return (f.kind == failReset || f.kind == failClosed) && f.at.Before(stopped)
	}
	dayTrafficTolerating(t, "restart of "+node, inFlight, func(p *probe) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		p.mark("stop " + node)
		if _, err := clusterSh(ctx, "node-stop", node); err != nil {
			t.Fatal(err)
		}
		stopped = time.Now()
		p.mark(node + " stopped")
		settle(5 * time.Second) // off
		p.mark("start " + node)
		if _, err := clusterSh(ctx, "node-start", node); err != nil {
			t.Fatal(err)
		}
		p.mark(node + " Ready")
		waitFor(t, time.Minute, 200*time.Millisecond, "3 ready endpoints again", func() error {
			if ready, other := dayEndpoints(t); ready != 3 || other != 0 {
				return fmt.Errorf("%d ready endpoints, %d others", ready, other)
			}
			return nil
		})
		p.mark("3 endpoints ready")
		settle(2 * time.Second)
	})
	if dayProxy() != proxyName {
		return
	}
	// The node's proxy is back too.
	waitFor(t, time.Minute, 500*time.Millisecond, node+"'s proxy Ready", func() error {
		p, ok := proxyPods(t)[node]
		if !ok || !podReady(&p) {
			return fmt.Errorf("no Ready proxy pod on %s", node)
		}
		return nil
	})
}

// TestDayAPIServerRestart: kube-apiserver SIGKILLed and started again under traffic; afterwards
// the proxies follow a change again (their watches came back).
func TestDayAPIServerRestart(t *testing.T) {
	dayScale(t, 3)
	dayTraffic(t, "API server restart", func(p *probe) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		p.mark("kill kube-apiserver")
		if _, err := clusterSh(ctx, "apiserver-restart"); err != nil {
			t.Fatal(err)
		}
		p.mark("kube-apiserver ready")
		settle(3 * time.Second)
	})
	dayScale(t, 4) // waits until node-1's proxy answers from all four
}

// TestDayProxyKilled: the service proxy's container on node-1, where the traffic enters, SIGKILLed
// under traffic; the kubelet restarts it. Nothing may be refused or go unanswered at connect: the
// rules stay, and with this proxy the holder keeps the listening sockets, so the connections
// made while no proxy runs wait in the kernel's accept queue until the next process serves
// them. Those that wait longer than the client's 0.5 s (the kubelet's restart takes about a
// second) are "no answer", and those the killed process was relaying "reset" or "closed": the
// test reports them (TestProxyKilled, with a patient client, asserts that every waiting
// connection is answered) and fails on the others.
func TestDayProxyKilled(t *testing.T) {
	const node = "node-1"
	dayScale(t, 3)
	selector, container := proxyLabel, proxyName
	if dayProxy() != proxyName {
		selector, container = "k8s-app=kube-proxy", "kube-proxy"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pods, err := env.client.CoreV1().Pods(proxyNS).List(ctx, metav1.ListOptions{LabelSelector: selector, FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		t.Fatal(err)
	}
	if len(pods.Items) != 1 {
		t.Fatalf("%d pods of %s on %s, want 1", len(pods.Items), dayProxy(), node)
	}
	pod := pods.Items[0]
	var id string
	var restarts int32
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == container {
			id, restarts = strings.TrimPrefix(cs.ContainerID, "containerd://"), cs.RestartCount
		}
	}
	if id == "" {
		t.Fatalf("pod %s: no running container %s", pod.Name, container)
	}
	tolerated := func(f failure) bool { return f.kind == failTimeout || f.kind == failReset || f.kind == failClosed }
	dayTrafficTolerating(t, "proxy SIGKILL on "+node, tolerated, func(p *probe) {
		p.mark("SIGKILL " + dayProxy() + " on " + node)
		if _, err := onNode(ctx, node, "ctr", "-a", filepath.Join(env.state, node, "containerd.sock"), "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", id); err != nil {
			t.Fatal(err)
		}
		waitFor(t, time.Minute, 100*time.Millisecond, "the kubelet restarts "+container, func() error {
			q, err := env.client.CoreV1().Pods(proxyNS).Get(ctx, pod.Name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			for _, cs := range q.Status.ContainerStatuses {
				if cs.Name == container && cs.RestartCount > restarts && cs.State.Running != nil && podReady(q) {
					return nil
				}
			}
			return fmt.Errorf("not restarted and Ready yet")
		})
		p.mark(container + " Ready again")
		settle(2 * time.Second)
	})
}
