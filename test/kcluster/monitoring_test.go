//go:build cluster

package kcluster

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// monNS holds what the monitoring test makes: a Deployment it churns, a Service with a failing
// endpoint beside a good one, a Service whose only endpoint fails, and Services with an invalid
// annotation (each makes every proxy write a Warning Event: POST requests).
const monNS = "kup-mon"

// refusingIP refuses TCP to any port: the client namespace, where nothing listens.
const refusingIP = clientIP

const monYAML = `
apiVersion: v1
kind: Namespace
metadata: {name: kup-mon}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: churn, namespace: kup-mon}
spec:
  replicas: 1
  selector: {matchLabels: {app: churn}}
  template:
    metadata: {labels: {app: churn}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
      - name: echo
        image: kup-echo:dev
        imagePullPolicy: Never
        args: [serve, --name, churn, --listen, "0.0.0.0:8080"]
        readinessProbe:
          tcpSocket: {port: 8080}
          periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata: {name: churn, namespace: kup-mon}
spec:
  selector: {app: churn}
  ports: [{name: tcp, port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: failover, namespace: kup-mon}
spec:
  ports: [{name: tcp, port: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: dead, namespace: kup-mon}
spec:
  ports: [{name: tcp, port: 80}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: dead
  namespace: kup-mon
  labels: {kubernetes.io/service-name: dead, endpointslice.kubernetes.io/managed-by: kup-e2e}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- addresses: [` + refusingIP + `]
  conditions: {ready: true}
`

// failoverSlice: the failover Service's endpoints: an echo pod and an address that refuses.
func failoverSlice(podIP string) string {
	return `
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: failover
  namespace: kup-mon
  labels: {kubernetes.io/service-name: failover, endpointslice.kubernetes.io/managed-by: kup-e2e}
addressType: IPv4
ports: [{name: tcp, port: 8080, protocol: TCP}]
endpoints:
- addresses: [` + podIP + `]
  conditions: {ready: true}
- addresses: [` + refusingIP + `]
  conditions: {ready: true}
`
}

func monBadServiceYAML(i int) string {
	return fmt.Sprintf(`
apiVersion: v1
kind: Service
metadata:
  name: bad-%d
  namespace: kup-mon
  labels: {kup-mon: bad}
  annotations: {kube-userspace-proxy.io/proxy-protocol: v3}
spec:
  ports: [{name: tcp, port: 80}]
`, i)
}

// activity is the traffic and churn the dashboards' queries need data from, until stopped: new
// connections to the echo NodePort of every node from outside; through node-1, connections to
// the failover Service (which must all be answered: the proxy passes over the refusing
// endpoint) and to the dead one (which all fail); DNS over UDP from every node (CoreDNS behind
// the kube-dns Service); and every 20 s, the churn Deployment's pod replaced (EndpointSlice
// changes: network programming) and a new Service with an invalid annotation (Events).
type activity struct {
	stop        chan struct{}
	done        sync.WaitGroup
	conns, dns  atomic.Int64
	failoverOK  atomic.Int64
	mu          sync.Mutex // guards errs
	errs        []string
	failoverErr []string
}

func (a *activity) errorf(format string, args ...any) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.errs) < 20 {
		a.errs = append(a.errs, fmt.Sprintf(format, args...))
	}
}

func startActivity(t *testing.T) *activity {
	t.Helper()
	a := &activity{stop: make(chan struct{})}
	failover := net.JoinHostPort(clusterIPOf(t, monNS, "failover"), "80")
	dead := net.JoinHostPort(clusterIPOf(t, monNS, "dead"), "80")
	every := func(d time.Duration, f func(i int)) {
		a.done.Add(1)
		go func() {
			defer a.done.Done()
			tick := time.NewTicker(d)
			defer tick.Stop()
			for i := 0; ; i++ {
				select {
				case <-a.stop:
					return
				case <-tick.C:
					f(i)
				}
			}
		}()
	}
	every(200*time.Millisecond, func(i int) {
		n := nodes[i%len(nodes)]
		if _, _, err := where("client").ask(net.JoinHostPort(nodeIP(n), strconv.Itoa(wl.nodePort)), 5*time.Second); err != nil {
			a.errorf("echo-np through %s: %v", n, err)
			return
		}
		a.conns.Add(1)
	})
	every(500*time.Millisecond, func(int) {
		if _, _, err := where("node-1").ask(failover, 5*time.Second); err != nil {
			a.mu.Lock()
			a.failoverErr = append(a.failoverErr, err.Error())
			a.mu.Unlock()
		} else {
			a.failoverOK.Add(1)
		}
		_, _, _ = where("node-1").ask(dead, 5*time.Second) // fails: its only endpoint refuses
	})
	every(time.Second, func(i int) {
		n := where(nodes[i%len(nodes)])
		r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return n.dial(ctx, "udp", net.JoinHostPort(dnsIP, "53"))
		}}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := r.LookupHost(ctx, "kubernetes.default.svc.cluster.local"); err != nil {
			a.errorf("DNS over UDP from %s: %v", n, err)
			return
		}
		a.dns.Add(1)
	})
	every(20*time.Second, func(i int) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := env.client.CoreV1().Pods(monNS).DeleteCollection(ctx, metav1.DeleteOptions{},
			metav1.ListOptions{LabelSelector: "app=churn"}); err != nil {
			a.errorf("replacing the churn pod: %v", err)
		}
		if _, err := run(ctx, []byte(monBadServiceYAML(i)), env.kubectl, "apply", "-f", "-"); err != nil {
			a.errorf("Service bad-%d: %v", i, err)
		}
		if i > 0 {
			_ = env.client.CoreV1().Services(monNS).Delete(ctx, fmt.Sprintf("bad-%d", i-1), metav1.DeleteOptions{})
		}
	})
	return a
}

// finish stops the activity and fails the test on its errors.
func (a *activity) finish(t *testing.T) {
	t.Helper()
	select {
	case <-a.stop:
		return
	default:
	}
	close(a.stop)
	a.done.Wait()
	t.Logf("activity: %d connections through the NodePorts, %d DNS answers, failover Service: %d answered, %d failed",
		a.conns.Load(), a.dns.Load(), a.failoverOK.Load(), len(a.failoverErr))
	for _, e := range a.errs {
		t.Errorf("activity: %s", e)
	}
	if len(a.failoverErr) > 0 {
		t.Errorf("the failover Service (an echo pod and a refusing endpoint) failed %d connections; first: %v",
			len(a.failoverErr), a.failoverErr[:min(len(a.failoverErr), 5)])
	}
}

// TestMonitoring: the cluster's Prometheus (hack/cluster.sh monitoring, brought up here if it
// does not run) scrapes every node's proxy as job kube-proxy and the API server as job
// apiserver; after traffic and churn, every query of every panel of the kubernetes-mixin's
// Proxy dashboard and of ours (deploy/monitoring) returns data, and so does every recording
// rule and what every alert compares; the alerts the traffic provokes go pending
// (TestMonitoringAlerts, build tag clustermon, has the mixin's alerts go pending and resolve).
func TestMonitoring(t *testing.T) {
	workload(t)
	prom := startMonitoring(t)
	kubectlApply(t, monYAML)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		// Gone before the next run applies it again.
		_, _ = run(ctx, nil, env.kubectl, "delete", "namespace", monNS, "--timeout=100s")
	})
	kubectlApply(t, failoverSlice(echoPodIP(t)))
	kubectl(t, 2*time.Minute, "-n", monNS, "rollout", "status", "deployment/churn", "--timeout=100s")

	t.Run("targets", func(t *testing.T) { checkTargets(t, prom) })
	handoverSeen(t, prom)

	a := startActivity(t)
	defer a.finish(t)
	// The rate windows ($__rate_interval: 70 s; the rules' 5m) need two scrapes after the first
	// of each series.
	time.Sleep(3 * scrapeInterval)
	deadline := time.Now().Add(3 * time.Minute)
	t.Run("kubernetes-mixin Proxy dashboard", func(t *testing.T) {
		checkDashboard(t, prom, monitoringFile("kubernetes-mixin/proxy.json"), deadline)
	})
	t.Run("kube-userspace-proxy dashboard", func(t *testing.T) {
		checkDashboard(t, prom, monitoringFile("kube-userspace-proxy-dashboard.json"), deadline)
	})
	t.Run("rules", func(t *testing.T) {
		for _, f := range []string{"kubernetes-mixin/kube-proxy-alerts.yaml", "kube-userspace-proxy-rules.yaml"} {
			checkRules(t, prom, ruleFile(t, monitoringFile(f)), deadline)
		}
	})
	t.Run("provoked alerts pending or firing", func(t *testing.T) {
		for _, q := range []string{
			`ALERTS{alertname="KubeUserspaceProxyConnectionsFailing", alertstate=~"pending|firing", namespace="kup-mon", service="dead"}`,
			`ALERTS{alertname="KubeUserspaceProxyEndpointDialFailures", alertstate=~"pending|firing", namespace="kup-mon", service="failover", endpoint="` + refusingIP + `:8080"}`,
			`ALERTS{alertname="KubeUserspaceProxyEndpointDialFailures", alertstate=~"pending|firing", namespace="kup-mon", service="dead"}`,
		} {
			waitData(t, prom, q, time.Now().Add(time.Minute))
		}
	})
	a.finish(t)
}

// echoPodIP returns the IP of one of the echo Deployment's pods.
func echoPodIP(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pods, err := env.client.CoreV1().Pods(echoNS).List(ctx, metav1.ListOptions{LabelSelector: "app=echo"})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		if podReady(&p) && p.Status.PodIP != "" {
			return p.Status.PodIP
		}
	}
	t.Fatal("no Ready echo pod")
	return ""
}

// waitData polls query until it returns a sample that is a number, failing the test at deadline
// (or at once on an invalid query).
func waitData(t testing.TB, prom, query string, deadline time.Time) []sample {
	t.Helper()
	for {
		got, err := promQuery(prom, query)
		if err != nil && strings.Contains(err.Error(), "bad_data") {
			t.Errorf("%v", err)
			return nil
		}
		if err == nil && hasNumber(got) {
			return got
		}
		if time.Now().After(deadline) {
			t.Errorf("no data: %s\n  last answer: %v %v", query, got, err)
			return nil
		}
		time.Sleep(2 * time.Second)
	}
}

// waitEmpty polls query until it returns nothing.
func waitEmpty(t testing.TB, prom, query string, timeout time.Duration) {
	t.Helper()
	waitFor(t, timeout, 2*time.Second, "no answer to "+query, func() error {
		got, err := promQuery(prom, query)
		if err != nil {
			return err
		}
		if len(got) > 0 {
			return fmt.Errorf("%v", got)
		}
		return nil
	})
}

// checkTargets: one kube-proxy target per node, up, with the node's name as instance and node;
// the API server's target up.
func checkTargets(t *testing.T, prom string) {
	waitFor(t, 2*time.Minute, 2*time.Second, "every node's proxy and the API server scraped", func() error {
		got, err := promQuery(prom, `up{job="kube-proxy"} == 1`)
		if err != nil {
			return err
		}
		seen := map[string]bool{}
		for _, s := range got {
			if s.labels["instance"] != s.labels["node"] || !strings.HasPrefix(s.labels["pod"], proxyName+"-") {
				return fmt.Errorf("target %v: want instance and node the node's name, pod the proxy's", s.labels)
			}
			seen[s.labels["instance"]] = true
		}
		for _, n := range nodes {
			if !seen[n] {
				return fmt.Errorf("no kube-proxy target of %s up: %v", n, got)
			}
		}
		api, err := promQuery(prom, `up{job="apiserver"} == 1`)
		if err != nil {
			return err
		}
		if len(api) != 1 {
			return fmt.Errorf("apiserver targets up: %v", api)
		}
		return nil
	})
}

// handoverSeen makes sure the proxies have hand-over metrics: a rolling update of the DaemonSet
// (each new proxy takes over from the old one) unless an earlier one left them.
func handoverSeen(t *testing.T, prom string) {
	t.Helper()
	got, err := promQuery(prom, `kube_userspace_proxy_handovers_total{job="kube-proxy"}`)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) > 0 {
		return
	}
	before := proxyPods(t)
	kubectl(t, 30*time.Second, "-n", proxyNS, "rollout", "restart", "daemonset/"+proxyName)
	kubectl(t, rolloutLimit+30*time.Second, "-n", proxyNS, "rollout", "status", "daemonset/"+proxyName, "--timeout="+rolloutLimit.String())
	waitFor(t, time.Minute, time.Second, "old proxy pods gone", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		pods, err := env.client.CoreV1().Pods(proxyNS).List(ctx, metav1.ListOptions{LabelSelector: proxyLabel})
		if err != nil {
			return err
		}
		if len(pods.Items) != len(nodes) {
			return fmt.Errorf("%d proxy pods", len(pods.Items))
		}
		for _, p := range pods.Items {
			if before[p.Spec.NodeName].UID == p.UID || !podReady(&p) {
				return fmt.Errorf("%s: pod %s (old or not Ready)", p.Spec.NodeName, p.Name)
			}
		}
		return nil
	})
	waitData(t, prom, `kube_userspace_proxy_handovers_total{job="kube-proxy", role="successor", result="completed"}`, time.Now().Add(time.Minute))
}

// grafanaVars: the values a Grafana shows these dashboards with: every instance ("All", whose
// value is the variables' allValue .+), the cluster variable as label_values finds it (none:
// this Prometheus adds no cluster label, and the dashboards then match series without one),
// $__interval the panels' minimum interval (1m), $__rate_interval as Grafana computes it from
// that and the scrape interval.
func grafanaVars(expr string) string {
	rateInterval := max(time.Minute+scrapeInterval, 4*scrapeInterval)
	return strings.NewReplacer(
		"$__rate_interval", fmt.Sprintf("%ds", int(rateInterval.Seconds())),
		"$__interval", "1m",
		"$instance", ".+",
		"$cluster", "",
	).Replace(expr)
}

// checkDashboard runs every query of a dashboard's panels and variables.
func checkDashboard(t *testing.T, prom, file string, deadline time.Time) {
	queries, vars := dashboardQueries(t, file)
	for _, q := range queries {
		expr := grafanaVars(q.expr)
		if strings.Contains(expr, "$") {
			t.Errorf("panel %q: a variable left in %s", q.panel, expr)
			continue
		}
		if why := mayBeEmpty(expr); why != "" {
			got, err := promQuery(prom, expr)
			if err != nil {
				t.Errorf("panel %q (%s): %v", q.panel, q.legend, err)
			}
			t.Logf("panel %q, line %s, may be empty (%s): %v", q.panel, q.legend, why, got)
			continue
		}
		got := waitData(t, prom, expr, deadline)
		if got != nil {
			t.Logf("panel %q, line %s: %d series, e.g. %v", q.panel, q.legend, len(got), got[0])
		}
	}
	for name, q := range vars {
		sel, label, ok := labelValues(q)
		if !ok {
			t.Errorf("variable %s: query %q is not label_values(SELECTOR, LABEL)", name, q)
			continue
		}
		got, err := promQuery(prom, fmt.Sprintf("count by (%s) (%s)", label, grafanaVars(sel)))
		if err != nil {
			t.Errorf("variable %s: %v", name, err)
			continue
		}
		values := map[string]bool{}
		for _, s := range got {
			values[s.labels[label]] = true
		}
		switch label {
		case "instance":
			for _, n := range nodes {
				if !values[n] {
					t.Errorf("variable %s (%s) lacks %s: %v", name, q, n, values)
				}
			}
		case "cluster":
			if len(values) != 1 || !values[""] {
				t.Errorf("variable %s (%s): %v, want no cluster label", name, q, values)
			}
		}
	}
}

// mayBeEmpty says why a panel's query may have no data with kube-proxy v1.36.3 as with this
// proxy (both measured on this cluster, hack/cluster.sh proxy kube-proxy-iptables), or "".
func mayBeEmpty(expr string) string {
	switch {
	case strings.Contains(expr, "rest_client_requests_total") && strings.Contains(expr, `code=~"`) && !strings.Contains(expr, `code=~"2..`):
		// The request-rate panel's 2xx line is checked.
		return "no 3xx, 4xx or 5xx answers from a healthy API server"
	case strings.Contains(expr, "rest_client_request_duration_seconds_bucket") && strings.Contains(expr, `verb="GET"`):
		return "the informers list through watches (client-go's WatchListClient), which count in rest_client_requests_total only; no other GET"
	}
	return ""
}

// labelValues splits Grafana's label_values(SELECTOR, LABEL).
func labelValues(q string) (selector, label string, ok bool) {
	q = strings.TrimSpace(q)
	if !strings.HasPrefix(q, "label_values(") || !strings.HasSuffix(q, ")") {
		return "", "", false
	}
	inner := strings.TrimSuffix(strings.TrimPrefix(q, "label_values("), ")")
	i := strings.LastIndex(inner, ",")
	if i < 0 {
		return "", "", false
	}
	return strings.TrimSpace(inner[:i]), strings.TrimSpace(inner[i+1:]), true
}

// checkRules: every recording rule's expression has data and so has the series it records;
// what every alert compares (or asks the absence of) has data.
func checkRules(t *testing.T, prom string, rules []rule, deadline time.Time) {
	for _, r := range rules {
		switch {
		case r.Record != "":
			waitData(t, prom, r.Expr, deadline)
			waitData(t, prom, r.Record, deadline)
		case r.Alert != "":
			q := compared(r.Expr)
			if q == r.Expr {
				t.Errorf("alert %s: no comparison or absent() in %s", r.Alert, r.Expr)
				continue
			}
			if got := waitData(t, prom, q, deadline); got != nil {
				t.Logf("alert %s compares %d series, e.g. %v", r.Alert, len(got), got[0])
			}
		default:
			t.Errorf("group %s: a rule neither recording nor alerting", r.Group)
		}
	}
}
