//go:build linux

package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal/transparent"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// haproxyPort is where the PROXY-protocol backend listens in pod p1.
const haproxyPort = 8090

// peerOf asks addr over network from ns until it answers and returns the peer address the backend
// saw.
func peerOf(t *testing.T, ns *netns.NS, network, addr string) netip.Addr {
	t.Helper()
	var a harness.Answer
	harness.WaitFor(t, converge, func() error {
		var err error
		a, err = harness.Ask(context.Background(), ns, network, addr)
		return err
	})
	return a.Peer.Addr()
}

// transparentState returns what the node holds of the transparent routing: ip rules, the
// routes of its table and the mangle table.
func transparentState(t *testing.T, node *netns.Node) (rules, routes, mangle string) {
	t.Helper()
	rules = node.Run(t, "ip", "rule")
	routes = node.Run(t, "ip", "route", "show", "table", fmt.Sprint(transparent.DefaultTable))
	mangle = node.Run(t, "iptables-save", "-t", "mangle")
	return rules, routes, mangle
}

func checkTransparentRouting(t *testing.T, node *netns.Node, want bool) {
	t.Helper()
	rules, routes, mangle := transparentState(t, node)
	has := map[string]bool{
		"ip rule":      strings.Contains(rules, fmt.Sprintf("lookup %d", transparent.DefaultTable)),
		"local route":  strings.Contains(routes, "local default dev lo"),
		"mangle rules": strings.Contains(mangle, transparent.Chain),
	}
	for what, ok := range has {
		if ok != want {
			t.Errorf("%s present=%v, want %v\nip rule:\n%s\ntable %d:\n%s\nmangle:\n%s", what, ok, want, rules, transparent.DefaultTable, routes, mangle)
		}
	}
}

// startHAProxy runs HAProxy in pod with a frontend that accepts the PROXY protocol (v1 and v2)
// and answers every HTTP request with the client address it learnt from the header, which it
// also logs.
func startHAProxy(t *testing.T, pod *netns.Pod) *netns.Process {
	t.Helper()
	cfg := fmt.Sprintf(`global
    log stdout format raw local0
defaults
    mode http
    log global
    timeout connect 5s
    timeout client 10s
    timeout server 10s
frontend pp
    bind %s:%d accept-proxy
    log-format "PROXY client %%ci:%%cp"
    http-request return status 200 content-type text/plain lf-string "%%ci\n"
`, pod.IP, haproxyPort)
	path := filepath.Join(t.TempDir(), "haproxy.cfg")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return pod.Start(t, "haproxy", "-db", "-f", path)
}

// httpClientAddr sends one HTTP request from ns to addr and returns the body of the answer.
func httpClientAddr(ctx context.Context, ns *netns.NS, addr string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	c, err := ns.DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\n\r\n"); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	if err != nil {
		return "", err
	}
	resp := string(b)
	if !strings.HasPrefix(resp, "HTTP/1.") || !strings.Contains(resp, " 200 ") {
		return "", fmt.Errorf("answer %q", resp)
	}
	_, body, _ := strings.Cut(resp, "\r\n\r\n")
	return strings.TrimSpace(body), nil
}

// TestTransparent: an outside client reaching an externalTrafficPolicy: Local NodePort or
// load-balancer IP is seen by the pod with its own address (TCP and UDP); Cluster services show
// a node address; PROXY protocol backends learn the client's address from the header;
// --transparent-local=false restores node addresses; SIGTERM and --cleanup remove the routing.
func TestTransparent(t *testing.T) {
	if _, err := exec.LookPath("haproxy"); err != nil {
		t.Fatalf("haproxy is required (Debian package haproxy, in hack/install-deps.sh): %v", err)
	}
	f := newFixture(t)
	ctx := context.Background()
	clientIP := f.client.IP

	local := harness.NodePortService("local", harness.TCPPort("tcp", 80, echoPort), harness.UDPPort("udp", 53, echoPort))
	local.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	local = f.serve(ctx, t, local, 0)
	lb := harness.NodePortService("local-lb", harness.TCPPort("tcp", 9100, echoPort), harness.UDPPort("udp", 9101, echoPort))
	lb.Spec.Type = corev1.ServiceTypeLoadBalancer
	lb.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	lb = f.serve(ctx, t, lb, 1)
	lb.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: lbIP.String()}}
	if _, err := f.c.Client.CoreV1().Services(lb.Namespace).UpdateStatus(ctx, lb, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	cluster := f.serve(ctx, t, harness.NodePortService("cluster", harness.TCPPort("tcp", 80, echoPort), harness.UDPPort("udp", 53, echoPort)), 2)

	localAddrs := map[string]string{
		"NodePort/tcp": harness.NodePortAddr(f.node.IP, local, 0),
		"NodePort/udp": harness.NodePortAddr(f.node.IP, local, 1),
		"LB IP/tcp":    netip.AddrPortFrom(lbIP, 9100).String(),
		"LB IP/udp":    netip.AddrPortFrom(lbIP, 9101).String(),
	}
	network := func(name string) string { return name[strings.LastIndex(name, "/")+1:] }

	t.Run("Local keeps the client address", func(t *testing.T) {
		checkTransparentRouting(t, f.node, true)
		for name, addr := range localAddrs {
			t.Run(name, func(t *testing.T) {
				if got := peerOf(t, f.client.NS, network(name), addr); got != clientIP {
					t.Errorf("pod saw %v, want the outside client's %v", got, clientIP)
				}
			})
		}
	})

	t.Run("Cluster shows the node", func(t *testing.T) {
		for i, nw := range []string{"tcp", "udp"} {
			if got := peerOf(t, f.client.NS, nw, harness.NodePortAddr(f.node.IP, cluster, i)); got == clientIP || !f.node.PodCIDR.Contains(got) && got != f.node.IP {
				t.Errorf("%s: pod saw %v, want a node address (not the client's %v)", nw, got, clientIP)
			}
		}
	})

	t.Run("PROXY protocol", func(t *testing.T) {
		hp := startHAProxy(t, f.backends[0])
		for _, v := range []string{"v1", "v2"} {
			t.Run(v, func(t *testing.T) {
				s := harness.NodePortService("pp-"+v, harness.TCPPort("http", 80, haproxyPort))
				s.Annotations = map[string]string{proxy.ProxyProtocolAnnotation: v}
				svc := f.serve(ctx, t, s, 0)
				var body string
				harness.WaitFor(t, converge, func() error {
					var err error
					body, err = httpClientAddr(ctx, f.client.NS, harness.NodePortAddr(f.node.IP, svc, 0))
					return err
				})
				if body != clientIP.String() {
					t.Errorf("HAProxy learnt client %q from the PROXY %s header, want %v; its log:\n%s", body, v, clientIP, hp.Tail(10))
				}
			})
		}
		if !strings.Contains(hp.Log(), "PROXY client "+clientIP.String()+":") {
			t.Errorf("HAProxy's log does not name the client %v:\n%s", clientIP, hp.Tail(20))
		}
	})

	t.Run("SIGTERM removes the routing", func(t *testing.T) {
		if err := f.proxy.Terminate(30 * time.Second); err != nil {
			t.Fatalf("SIGTERM: %v; log:\n%s", err, f.proxy.Tail(20))
		}
		checkTransparentRouting(t, f.node, false)
	})

	t.Run("flag off shows the node", func(t *testing.T) {
		cfg := f.proxyConfig()
		cfg.Args = append(cfg.Args, "--transparent-local=false")
		f.proxy = harness.StartProxy(t, f.node.NS, cfg)
		checkTransparentRouting(t, f.node, false)
		for name, addr := range localAddrs {
			if got := peerOf(t, f.client.NS, network(name), addr); got == clientIP {
				t.Errorf("%s: pod saw the client's address %v with --transparent-local=false", name, got)
			}
		}
		if err := f.proxy.Terminate(30 * time.Second); err != nil {
			t.Fatalf("SIGTERM: %v", err)
		}
	})

	t.Run("cleanup removes the routing", func(t *testing.T) {
		f.proxy = harness.StartProxy(t, f.node.NS, f.proxyConfig())
		waitTransparentEnabled(t, f.proxy)
		checkTransparentRouting(t, f.node, true)
		f.proxy.Stop() // SIGKILL: the routing stays behind
		checkTransparentRouting(t, f.node, true)
		harness.RunCleanup(t, f.node.NS)
		checkTransparentRouting(t, f.node, false)
	})
}

// waitTransparentEnabled waits until the proxy has programmed the reply routing of transparent
// connections, which a start does right after its first sync (so that it serves first).
func waitTransparentEnabled(t *testing.T, p *harness.Proxy) {
	t.Helper()
	harness.WaitFor(t, 30*time.Second, func() error {
		if !strings.Contains(p.Log(), "transparent connections for Local services enabled") {
			return errors.New("the proxy has not enabled transparent connections yet")
		}
		return nil
	})
}
