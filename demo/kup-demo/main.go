// Command kup-demo is the client of the docker-compose demo. It runs in the proxy's network
// namespace: it applies the demo's objects to the API server (deploy/rbac.yaml, a Node, the
// Service "echo" and its EndpointSlice with the two kup-echo containers), then sends requests to
// the ClusterIP and shows which backend answered: round robin, then ClientIP affinity, then
// echo-b stopped while requests flow. It exits 1 if any request failed or a phase did not show
// what it should.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/deploy"
)

const (
	namespace = "default"
	svcName   = "echo"
	echoPort  = 8080
	nodeName  = "demo-node"
)

func main() {
	kubeconfig := flag.String("kubeconfig", "", "admin kubeconfig")
	stopFile := flag.String("stop-file", "", "file whose creation stops echo-b (shared with its container)")
	flag.Parse()
	if err := run(*kubeconfig, *stopFile); err != nil {
		fmt.Printf("\nRESULT: FAILED: %v\n", err)
		os.Exit(1)
	}
	fmt.Println("\nRESULT: OK, no failed request")
}

func say(format string, args ...any) {
	fmt.Printf(format+"\n", args...)
}

func run(kubeconfig, stopFile string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	say("== 0. setup")
	start := time.Now()
	if err := retry(ctx, 2*time.Minute, func() error {
		_, err := client.Discovery().ServerVersion()
		if err != nil {
			return err
		}
		_, err = client.CoreV1().Namespaces().Get(ctx, "kube-system", metav1.GetOptions{})
		return err
	}); err != nil {
		return fmt.Errorf("API server not ready: %w", err)
	}
	say("kube-apiserver ready after %v", time.Since(start).Round(100*time.Millisecond))

	applier, err := deploy.NewApplier(cfg)
	if err != nil {
		return err
	}
	rbac, err := deploy.Objects("rbac.yaml")
	if err != nil {
		return err
	}
	for _, o := range rbac {
		if err := applier.Apply(ctx, o, false); err != nil {
			return err
		}
		say("applied %s %s (deploy/rbac.yaml)", o.GetKind(), o.GetName())
	}
	if _, err := client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}}, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create node: %w", err)
	}

	backends := map[string]string{}
	for _, name := range []string{"echo-a", "echo-b"} {
		addrs, err := net.DefaultResolver.LookupHost(ctx, name)
		if err != nil || len(addrs) == 0 {
			return fmt.Errorf("resolve %s: %v", name, err)
		}
		backends[name] = addrs[0]
	}
	svc, err := client.CoreV1().Services(namespace).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: svcName, Namespace: namespace},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{
			Name: "tcp", Port: 80, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(echoPort)}}},
	}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create service: %w", err)
	}
	if err := putSlice(ctx, client, backends, "echo-a", "echo-b"); err != nil {
		return err
	}
	addr := net.JoinHostPort(svc.Spec.ClusterIP, "80")
	// Traffic to the ClusterIP before the proxy has its portal would leave through the default
	// route: wait until the proxy's metrics count the service port.
	if err := retry(ctx, time.Minute, proxyHasPort); err != nil {
		return fmt.Errorf("the proxy never served the service: %w", err)
	}
	say("service %s/%s: ClusterIP %s, endpoints echo-a %s:%d, echo-b %s:%d", namespace, svcName, addr,
		backends["echo-a"], echoPort, backends["echo-b"], echoPort)
	start = time.Now()
	if err := retry(ctx, time.Minute, func() error { _, err := ask(addr); return err }); err != nil {
		return fmt.Errorf("service never answered: %w", err)
	}
	say("first answer through the proxy after %v", time.Since(start).Round(100*time.Millisecond))

	// 1. Round robin.
	say("\n== 1. round robin: 10 requests to %s, one connection each", addr)
	seen, err := series(addr, 10)
	if err != nil {
		return err
	}
	if seen["echo-a"] == 0 || seen["echo-b"] == 0 {
		return fmt.Errorf("round robin: answers %v, want both backends", seen)
	}

	// 2. ClientIP affinity.
	say("\n== 2. sessionAffinity: ClientIP (service patched): 10 requests")
	patch := []byte(`{"spec":{"sessionAffinity":"ClientIP"}}`)
	if _, err := client.CoreV1().Services(namespace).Patch(ctx, svcName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("patch affinity: %w", err)
	}
	// The proxy applies the change within its sync period: wait for 5 answers in a row from
	// the same backend before showing 10 more.
	if err := retry(ctx, 30*time.Second, func() error {
		s, err := quiet(addr, 5)
		if err != nil || len(s) != 1 {
			return fmt.Errorf("not sticky yet: %v %v", s, err)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("affinity: %w", err)
	}
	seen, err = series(addr, 10)
	if err != nil {
		return err
	}
	if len(seen) != 1 {
		return fmt.Errorf("affinity: answers %v, want one backend", seen)
	}

	// 3. A backend stopped while requests flow (affinity off again, so echo-b gets its share).
	say("\n== 3. affinity off again; echo-b stopped while a request goes out every 50ms")
	patch = []byte(`{"spec":{"sessionAffinity":"None"}}`)
	if _, err := client.CoreV1().Services(namespace).Patch(ctx, svcName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("patch affinity off: %w", err)
	}
	if err := retry(ctx, 30*time.Second, func() error {
		s, err := quiet(addr, 4)
		if err != nil || len(s) != 2 {
			return fmt.Errorf("not round robin yet: %v %v", s, err)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("affinity off: %w", err)
	}
	var (
		mu       sync.Mutex
		counts   = map[string]int{}
		failures []error
		total    int
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			name, err := ask(addr)
			mu.Lock()
			total++
			if err != nil {
				failures = append(failures, err)
			} else {
				counts[name]++
			}
			mu.Unlock()
		}
	})
	snapshot := func() string {
		mu.Lock()
		defer mu.Unlock()
		return fmt.Sprintf("%d requests, %d failed, answers %s", total, len(failures), fmtCounts(counts))
	}
	time.Sleep(time.Second)
	say("  before:                        %s", snapshot())
	if err := os.WriteFile(stopFile, nil, 0o644); err != nil {
		return fmt.Errorf("stop echo-b: %w", err)
	}
	echoB := net.JoinHostPort(backends["echo-b"], fmt.Sprint(echoPort))
	if err := retry(ctx, 30*time.Second, func() error {
		c, err := net.DialTimeout("tcp", echoB, time.Second)
		if err == nil {
			c.Close()
			return errors.New("echo-b still accepts")
		}
		return nil
	}); err != nil {
		return err
	}
	say("  echo-b killed (its port refuses); still in the EndpointSlice: the proxy retries each failed dial on echo-a")
	time.Sleep(2 * time.Second)
	say("  after the kill:                %s", snapshot())
	if err := putSlice(ctx, client, backends, "echo-a"); err != nil {
		return err
	}
	say("  echo-b removed from the EndpointSlice (what the EndpointSlice controller does for a dead pod)")
	time.Sleep(2 * time.Second)
	mu.Lock()
	counts = map[string]int{}
	mu.Unlock()
	time.Sleep(2 * time.Second)
	close(stop)
	wg.Wait()
	say("  last 2s, echo-b gone:          %s", snapshot())
	if len(failures) > 0 {
		return fmt.Errorf("%d failed requests, first: %v", len(failures), failures[0])
	}
	if counts["echo-b"] != 0 || counts["echo-a"] == 0 {
		return fmt.Errorf("after echo-b left: answers %v, want echo-a only", counts)
	}
	return nil
}

// putSlice creates or replaces the service's EndpointSlice with the named backends, ready.
func putSlice(ctx context.Context, client kubernetes.Interface, backends map[string]string, names ...string) error {
	name, proto, port := "tcp", corev1.ProtocolTCP, int32(echoPort)
	ready, node := true, nodeName
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: svcName + "-demo", Namespace: namespace,
			Labels: map[string]string{discoveryv1.LabelServiceName: svcName, discoveryv1.LabelManagedBy: "kup-demo"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &name, Protocol: &proto, Port: &port}},
	}
	for _, n := range names {
		slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{backends[n]},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready},
			NodeName:   &node,
			TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: namespace, Name: n},
		})
	}
	slices := client.DiscoveryV1().EndpointSlices(namespace)
	cur, err := slices.Get(ctx, slice.Name, metav1.GetOptions{})
	if err != nil {
		_, err = slices.Create(ctx, slice, metav1.CreateOptions{})
	} else {
		slice.ResourceVersion = cur.ResourceVersion
		_, err = slices.Update(ctx, slice, metav1.UpdateOptions{})
	}
	if err != nil {
		return fmt.Errorf("put EndpointSlice %s: %w", slice.Name, err)
	}
	return nil
}

// ask sends one line over a new connection and returns the name of the backend that answered.
func ask(addr string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintf(c, "hello\n"); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("read answer: %w", err)
	}
	name, _, _ := strings.Cut(line, " ")
	if name != "echo-a" && name != "echo-b" {
		return "", fmt.Errorf("answer %q is not from a backend", line)
	}
	return name, nil
}

// metricsURL is the proxy's metrics server (the client shares its network namespace).
const metricsURL = "http://127.0.0.1:10249/metrics"

// proxyHasPort reports nil once the proxy's metrics show at least one service port.
func proxyHasPort() error {
	resp, err := http.Get(metricsURL)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "kube_userspace_proxy_service_ports "); ok && v != "0" {
			return nil
		}
	}
	return errors.New("no service port in the proxy's metrics yet")
}

// series sends n requests, printing each answer, and returns the count per backend.
func series(addr string, n int) (map[string]int, error) {
	seen := map[string]int{}
	var line []string
	for i := 1; i <= n; i++ {
		name, err := ask(addr)
		if err != nil {
			return seen, fmt.Errorf("request %d: %w", i, err)
		}
		seen[name]++
		line = append(line, fmt.Sprintf("#%d %s", i, name))
	}
	say("  %s", strings.Join(line, "  "))
	say("  answers: %s", fmtCounts(seen))
	return seen, nil
}

func quiet(addr string, n int) (map[string]int, error) {
	seen := map[string]int{}
	for range n {
		name, err := ask(addr)
		if err != nil {
			return seen, err
		}
		seen[name]++
	}
	return seen, nil
}

func fmtCounts(m map[string]int) string {
	var keys []string
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	return "{" + strings.Join(parts, " ") + "}"
}

// retry calls fn every 200ms until it succeeds or timeout passes.
func retry(ctx context.Context, timeout time.Duration, fn func() error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		err := fn()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(200 * time.Millisecond):
		}
	}
}
