//go:build linux

package cluster_test

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/echo"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// TestPinsAgree checks that the versions the Go code looks for are those test/k8sbin/go.mod
// builds and test/cluster.mk asks for.
func TestPinsAgree(t *testing.T) {
	gomod, err := os.ReadFile("../k8sbin/go.mod")
	if err != nil {
		t.Fatal(err)
	}
	mk, err := os.ReadFile("../cluster.mk")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, file, text, want string
	}{
		{"go.mod kubernetes", "test/k8sbin/go.mod", string(gomod), "\tk8s.io/kubernetes " + cluster.KubernetesVersion + " "},
		{"go.mod etcd", "test/k8sbin/go.mod", string(gomod), "\tgo.etcd.io/etcd/server/v3 " + cluster.EtcdVersion + " "},
		{"cluster.mk kubernetes", "test/cluster.mk", string(mk), "\nKUP_K8S_VERSION  := " + cluster.KubernetesVersion + "\n"},
		{"cluster.mk etcd", "test/cluster.mk", string(mk), "\nKUP_ETCD_VERSION := " + cluster.EtcdVersion + "\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if !strings.Contains(tc.text, tc.want) {
				t.Errorf("%s does not contain %q", tc.file, tc.want)
			}
		})
	}
}

// fatalRecorder is a testing.TB whose Fatalf records the message and ends the goroutine, as
// the real one does.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (r *fatalRecorder) Helper() {}

func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.msg = "fail: " + fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func (r *fatalRecorder) Skipf(format string, args ...any) {
	r.msg = "skip: " + fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// TestMissingBinariesFailNamingTheTarget: without the binaries, Start ends the test naming
// kube-apiserver and make test-bins: a skip for a contributor's `go test ./...`, a failure under
// KUP_TEST_ALL=1 (make test).
func TestMissingBinariesFailNamingTheTarget(t *testing.T) {
	for _, all := range []string{"", "1"} {
		t.Setenv(testenv.AllVar, all)
		rec := &fatalRecorder{TB: t}
		done := make(chan struct{})
		go func() {
			defer close(done)
			cluster.Start(rec, cluster.Options{BinDir: t.TempDir()})
			rec.msg = "Start returned"
		}()
		<-done
		want := "skip: "
		if all == "1" {
			want = "fail: "
		}
		if !strings.HasPrefix(rec.msg, want) || !strings.Contains(rec.msg, "make test-bins") || !strings.Contains(rec.msg, "kube-apiserver") {
			t.Errorf("%s=%s: Start with no binaries: %q, want %q naming kube-apiserver and make test-bins", testenv.AllVar, all, rec.msg, want)
		}
	}
}

// TestCluster starts one control plane and proves, case by case, what the benchmark and the
// end-to-end tests rely on.
func TestCluster(t *testing.T) {
	n := netns.NewNetwork(t, "clu")
	c := cluster.Start(t, cluster.Options{Network: n})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	t.Run("kubernetes service", func(t *testing.T) {
		svc, err := c.Client.CoreV1().Services(metav1.NamespaceDefault).Get(ctx, "kubernetes", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if svc.Spec.ClusterIP != "10.96.0.1" {
			t.Errorf("kubernetes service ClusterIP = %s, want the first address of %s", svc.Spec.ClusterIP, cluster.ServiceCIDR)
		}
	})

	t.Run("service and endpointslice round trip", func(t *testing.T) {
		svc, slice := echoService("roundtrip", 8080, []netip.Addr{netip.MustParseAddr("10.244.1.2")}, nil)
		created := createService(ctx, t, c.Client, svc, slice)
		if !netip.MustParsePrefix(cluster.ServiceCIDR).Contains(netip.MustParseAddr(created.Spec.ClusterIP)) {
			t.Errorf("ClusterIP %s not in %s", created.Spec.ClusterIP, cluster.ServiceCIDR)
		}
		got, err := c.Client.DiscoveryV1().EndpointSlices(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{
			LabelSelector: discoveryv1.LabelServiceName + "=roundtrip",
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(got.Items) != 1 || len(got.Items[0].Endpoints) != 1 || got.Items[0].Endpoints[0].Addresses[0] != "10.244.1.2" {
			t.Errorf("EndpointSlices of roundtrip = %+v, want one with endpoint 10.244.1.2", got.Items)
		}
	})

	t.Run("service account token", func(t *testing.T) {
		token, err := c.Token(ctx, metav1.NamespaceDefault, "reader")
		if err != nil {
			t.Fatal(err)
		}
		sa, err := kubernetes.NewForConfig(c.RESTConfigFor(token))
		if err != nil {
			t.Fatal(err)
		}
		// Authenticated (the server knows who it is) but granted nothing (RBAC is on).
		_, err = sa.CoreV1().Services(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{})
		if !apierrors.IsForbidden(err) {
			t.Fatalf("listing services without a role binding: %v, want Forbidden", err)
		}
		if !strings.Contains(err.Error(), "system:serviceaccount:default:reader") {
			t.Errorf("forbidden error does not name the service account: %v", err)
		}
	})

	t.Run("kube-proxy iptables ClusterIP", func(t *testing.T) {
		nodeA := n.AddNode(t, "na")
		nodeB := n.AddNode(t, "nb")
		podA := n.AddPod(t, nodeA, "pa")
		podB := n.AddPod(t, nodeB, "pb")
		const targetPort = 8080
		for _, p := range []*netns.Pod{podA, podB} {
			ln, err := p.Listen("tcp4", fmt.Sprintf(":%d", targetPort))
			if err != nil {
				t.Fatal(err)
			}
			srv := echo.ServeTCP(ln, p.IP.String())
			t.Cleanup(func() { _ = srv.Close() })
		}
		if _, err := c.CreateNode(ctx, "node-a", nodeA.IP); err != nil {
			t.Fatal(err)
		}
		c.KubeProxy(t, nodeA.NS, "node-a")
		// KubeProxy returns once the rules are there: the API server's own Service is in them.
		if rules := nodeA.Run(t, "iptables-save", "-t", "nat"); !strings.Contains(rules, `"default/kubernetes:https cluster IP"`) {
			t.Errorf("kube-proxy has not programmed default/kubernetes when KubeProxy returns; nat table:\n%s", rules)
		}

		svc, slice := echoService("echo", targetPort, []netip.Addr{podA.IP, podB.IP}, []string{"node-a", "node-b"})
		created := createService(ctx, t, c.Client, svc, slice)
		vip := netip.AddrPortFrom(netip.MustParseAddr(created.Spec.ClusterIP), 80).String()

		clients := []struct {
			name string
			from *netns.NS
		}{
			{"from the node", nodeA.NS},
			{"from a pod on the node", podA.NS},
		}
		for _, cl := range clients {
			t.Run(cl.name, func(t *testing.T) {
				// kube-proxy programs the service within seconds; until then the
				// ClusterIP leads nowhere.
				waitEcho(ctx, t, cl.from, vip, 30*time.Second, nodeA.NS)
				// Both endpoints, one on this node and one on the other, get traffic.
				seen := map[string]bool{}
				for i := 0; i < 60 && len(seen) < 2; i++ {
					cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
					banner, err := echo.Check(cctx, cl.from.DialContext, "tcp", vip, fmt.Sprintf("hello %d", i))
					ccancel()
					if err != nil {
						t.Fatalf("connection %d to %s: %v", i, vip, err)
					}
					seen[banner] = true
				}
				for _, p := range []*netns.Pod{podA, podB} {
					if !seen[p.IP.String()] {
						t.Errorf("no connection to %s reached endpoint %s (reached %v)", vip, p.IP, seen)
					}
				}
			})
		}
	})
}

// echoService returns a ClusterIP Service name with port 80 → targetPort and an EndpointSlice
// for it holding ips (on nodes, if given).
func echoService(name string, targetPort int32, ips []netip.Addr, nodes []string) (*corev1.Service, *discoveryv1.EndpointSlice) {
	portName := "echo"
	proto := corev1.ProtocolTCP
	ready := true
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: metav1.NamespaceDefault},
		Spec: corev1.ServiceSpec{
			Type: corev1.ServiceTypeClusterIP,
			Ports: []corev1.ServicePort{{
				Name: portName, Protocol: proto, Port: 80, TargetPort: intstr.FromInt32(targetPort),
			}},
		},
	}
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name:      name + "-1",
			Namespace: metav1.NamespaceDefault,
			Labels: map[string]string{
				discoveryv1.LabelServiceName: name,
				discoveryv1.LabelManagedBy:   "kup-test",
			},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Protocol: &proto, Port: &targetPort}},
	}
	for i, ip := range ips {
		ep := discoveryv1.Endpoint{
			Addresses:  []string{ip.String()},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready},
		}
		if i < len(nodes) {
			ep.NodeName = &nodes[i]
		}
		slice.Endpoints = append(slice.Endpoints, ep)
	}
	return svc, slice
}

// createService creates svc and slice and returns the created Service (with its ClusterIP).
func createService(ctx context.Context, t *testing.T, client kubernetes.Interface, svc *corev1.Service, slice *discoveryv1.EndpointSlice) *corev1.Service {
	t.Helper()
	created, err := client.CoreV1().Services(svc.Namespace).Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.DiscoveryV1().EndpointSlices(slice.Namespace).Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return created
}

// waitEcho retries an echo exchange from ns to addr until it succeeds, failing the test after
// timeout with the NAT rules of ruleNS.
func waitEcho(ctx context.Context, t *testing.T, ns *netns.NS, addr string, timeout time.Duration, ruleNS *netns.NS) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last error
	for {
		cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
		_, last = echo.Check(cctx, ns.DialContext, "tcp", addr, "ping")
		ccancel()
		if last == nil {
			return
		}
		select {
		case <-ctx.Done():
			rules, err := ruleNS.Exec(context.Background(), "iptables-save", "-t", "nat")
			t.Fatalf("no echo from %s within %v: %v\nnat table of %s:\n%s", addr, timeout, errors.Join(last, err), ruleNS, rules)
		case <-time.After(250 * time.Millisecond):
		}
	}
}
