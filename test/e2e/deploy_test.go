//go:build linux

package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/deploy"
	kup "github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/events"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// TestDeploy applies every manifest of deploy/ to a real API server (server-side dry run, which
// runs admission and validation), then creates the RBAC objects for real and runs the proxy with
// the ServiceAccount's token and the ConfigMap's configuration: it must serve a ClusterIP
// service end to end with exactly those permissions, write its Events, and log no "forbidden".
func TestDeploy(t *testing.T) {
	n := netns.NewNetwork(t, "dep")
	c := cluster.Start(t, cluster.Options{Network: n})
	node := n.AddNode(t, "dn")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const depNode = "node-deploy"
	if _, err := c.CreateNode(ctx, depNode, node.IP); err != nil {
		t.Fatal(err)
	}

	objs, err := deploy.Objects()
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]bool{}
	a, err := deploy.NewApplier(c.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		kinds[o.GetKind()] = true
		if err := a.Apply(ctx, o, true); err != nil {
			t.Error(err)
		}
	}
	for _, k := range []string{"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"} {
		if !kinds[k] {
			t.Errorf("deploy/ has no %s", k)
		}
	}
	if t.Failed() {
		t.FailNow()
	}

	// The RBAC objects for real, then a token of the ServiceAccount and nothing else.
	rbac, err := deploy.Objects("rbac.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var saNS, saName string
	for _, o := range rbac {
		if err := a.Apply(ctx, o, false); err != nil {
			t.Fatal(err)
		}
		if o.GetKind() == "ServiceAccount" {
			saNS, saName = o.GetNamespace(), o.GetName()
		}
	}
	token, err := c.Token(ctx, saNS, saName)
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig := c.KubeconfigFor(t, token)

	// The ConfigMap's KubeProxyConfiguration, as the DaemonSet mounts it.
	cms, err := deploy.Objects("configmap.yaml")
	if err != nil {
		t.Fatal(err)
	}
	cfgText, _, err := unstructured.NestedString(cms[0].Object, "data", "config.yaml")
	if err != nil || cfgText == "" {
		t.Fatalf("configmap.yaml: no data.config.yaml (%v)", err)
	}
	cfgPath := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfgText), 0o600); err != nil {
		t.Fatal(err)
	}

	var eps []harness.Endpoint
	for _, name := range []string{"d1", "d2"} {
		p := n.AddPod(t, node, name)
		harness.StartEcho(t, p.NS, name, echoPort)
		eps = append(eps, harness.Endpoint{IP: p.IP, Node: depNode, Name: name})
	}
	clientPod := n.AddPod(t, node, "dcli")

	const healthz = "127.0.0.1:10256"
	proxy := harness.StartProxy(t, node.NS, harness.ProxyConfig{
		NodeName:           depNode,
		Kubeconfig:         kubeconfig,
		HealthzBindAddress: healthz, // the DaemonSet's probe port
		Args:               []string{"--config=" + cfgPath, "--iptables-min-sync-period=100ms"},
	})

	svc := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("deployed", harness.TCPPort("tcp", 80, echoPort)))
	harness.ApplySlice(ctx, t, c.Client, harness.Slice(svc, eps...))
	addr := harness.Addr(svc, 0)
	waitAnswer(t, clientPod.NS, "tcp", addr)
	expectBackends(ctx, t, clientPod.NS, "tcp", addr, 20, "d1", "d2")

	// The DaemonSet's probes: /livez and /healthz on the node's 10256.
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, address string) (net.Conn, error) {
			return node.DialContext(ctx, network, address)
		},
	}}
	for _, path := range []string{"/livez", "/healthz"} {
		harness.WaitFor(t, converge, func() error {
			resp, err := hc.Get("http://" + healthz + path)
			if err != nil {
				return err
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("GET %s: %s: %s", path, resp.Status, body)
			}
			return nil
		})
	}

	// Its Events, with exactly those permissions: the start event on its Node, and a Warning
	// on a Service it cannot serve as asked.
	waitEvent(ctx, t, c.Client, "default", func(e *eventsv1.Event) bool {
		return e.Regarding.Kind == "Node" && e.Regarding.Name == depNode && e.Reason == events.ReasonStarting
	})
	bad := harness.ClusterIPService("deployed-bad", harness.TCPPort("tcp", 80, echoPort))
	bad.Annotations = map[string]string{kup.ProxyProtocolAnnotation: "v9"}
	waitServiceEvent(ctx, t, c.Client, harness.CreateService(ctx, t, c.Client, bad), kup.ReasonInvalidField)

	if log := proxy.Log(); strings.Contains(strings.ToLower(log), "forbidden") {
		t.Errorf("the proxy's log mentions forbidden (RBAC not enough):\n%s", log)
	}
	if err := proxy.Terminate(30 * time.Second); err != nil {
		t.Errorf("terminate: %v", err)
	}
}
