//go:build linux

// Package cluster runs a real Kubernetes control plane (etcd and kube-apiserver) and real
// upstream kube-proxy processes inside network namespaces, for end-to-end tests and benchmarks.
//
// The binaries come from `make test-bins` (see test/cluster.mk and [DefaultBinDir]); a test that
// needs them and does not find them fails, naming that target. There is no scheduler, no
// controller manager and no kubelet: tests create Nodes, Services and EndpointSlices themselves,
// and pods are namespaces made with package netns.
//
//	n := netns.NewNetwork(t, "e2e")
//	c := cluster.Start(t, cluster.Options{Network: n})
//	node := n.AddNode(t, "node-a")
//	if _, err := c.CreateNode(ctx, "node-a", node.IP); err != nil { t.Fatal(err) }
//	kp := c.KubeProxy(t, node.NS, "node-a") // upstream kube-proxy, iptables mode
//	svc, err := c.Client.CoreV1().Services("default").Create(ctx, mySvc, metav1.CreateOptions{})
//
// Processes running inside namespaces use [Cluster.Kubeconfig]; the test process itself uses
// [Cluster.Client] (or [Cluster.RESTConfig]), which dials through the control-plane namespace.
// Everything is stopped and deleted in the test's cleanup.
package cluster

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// Fixed settings of the control plane. Each cluster has its own namespace, so fixed ports do
// not collide.
const (
	// ServiceCIDR is the API server's --service-cluster-ip-range.
	ServiceCIDR = "10.96.0.0/16"
	// APIServerPort is the API server's secure port on the control-plane host.
	APIServerPort = 6443
	// KubeProxyHealthzPort is upstream kube-proxy's health port (its default), on every address
	// of its node namespace.
	KubeProxyHealthzPort = 10256

	etcdClientURL = "http://127.0.0.1:2379"
	etcdPeerURL   = "http://127.0.0.1:2380"
	adminUser     = "admin"
)

// Options configures [Start]. The zero value is usable.
type Options struct {
	// Network is the topology to attach the control-plane namespace to. If nil, Start creates
	// one (see [Cluster.Network]).
	Network *netns.Network
	// BinDir holds kube-apiserver, kube-proxy and etcd. If empty, [DefaultBinDir] is used.
	BinDir string
	// APIServerArgs are appended to kube-apiserver's arguments (later flags win).
	APIServerArgs []string
	// ReadyTimeout bounds the wait for the API server's /readyz. If zero, 90 seconds.
	ReadyTimeout time.Duration
}

func (o Options) readyTimeout() time.Duration {
	if o.ReadyTimeout > 0 {
		return o.ReadyTimeout
	}
	return 90 * time.Second
}

// Cluster is a running control plane. Its fields must not be modified.
type Cluster struct {
	// Network is the topology the control plane is attached to.
	Network *netns.Network
	// ControlPlane is the namespace running etcd and kube-apiserver.
	ControlPlane *netns.Host
	// Etcd and APIServer are the running processes (their logs are shown when the test fails).
	Etcd, APIServer *netns.Process
	// URL is the API server's URL, reachable from every namespace of Network.
	URL string
	// AdminToken is a bearer token of a member of system:masters.
	AdminToken string
	// Kubeconfig is the path of an admin kubeconfig for processes inside Network's namespaces
	// (server URL, AdminToken, insecure-skip-tls-verify).
	Kubeconfig string
	// RESTConfig is an admin client configuration for the test process; it dials through the
	// control-plane namespace. Copy it (rest.CopyConfig) before changing it.
	RESTConfig *rest.Config
	// Client is a clientset built from RESTConfig.
	Client kubernetes.Interface

	binDir string
	dir    string // the cluster's temporary directory
}

// Start runs etcd and kube-apiserver in a new control-plane namespace attached to
// opts.Network, waits until the API server is ready (/readyz, the default and kube-system
// namespaces and the default/kubernetes Service exist), and
// registers in t.Cleanup that everything is stopped. It fails the test on error, including when
// the binaries have not been built (run `make test-bins`).
func Start(t testing.TB, opts Options) *Cluster {
	t.Helper()
	apiserverBin := binary(t, opts.BinDir, binAPIServer)
	etcdBin := binary(t, opts.BinDir, binEtcd)

	n := opts.Network
	if n == nil {
		n = netns.NewNetwork(t, "cluster")
	}
	cp := n.AddHost(t, "cp")
	c := &Cluster{
		Network:      n,
		ControlPlane: cp,
		URL:          "https://" + netip.AddrPortFrom(cp.IP, APIServerPort).String(),
		binDir:       filepath.Dir(apiserverBin),
		dir:          t.TempDir(),
	}
	token, err := randomHex(16)
	if err != nil {
		t.Fatalf("cluster: admin token: %v", err)
	}
	c.AdminToken = token
	if err := c.writeFiles(); err != nil {
		t.Fatalf("cluster: %v", err)
	}

	c.Etcd = cp.Start(t, etcdBin,
		"--name=default",
		"--data-dir="+filepath.Join(c.dir, "etcd"),
		"--listen-client-urls="+etcdClientURL,
		"--advertise-client-urls="+etcdClientURL,
		"--listen-peer-urls="+etcdPeerURL,
		"--initial-advertise-peer-urls="+etcdPeerURL,
		"--initial-cluster=default="+etcdPeerURL,
		"--unsafe-no-fsync", // a throw-away store
		"--log-level=warn",
	)
	args := []string{
		"--etcd-servers=" + etcdClientURL,
		"--service-account-key-file=" + filepath.Join(c.dir, "sa.pub"),
		"--service-account-signing-key-file=" + filepath.Join(c.dir, "sa.key"),
		"--service-account-issuer=https://kubernetes.default.svc",
		"--token-auth-file=" + filepath.Join(c.dir, "tokens.csv"),
		"--authorization-mode=RBAC",
		"--bind-address=0.0.0.0",
		"--secure-port=" + strconv.Itoa(APIServerPort),
		"--cert-dir=" + filepath.Join(c.dir, "certs"),
		"--service-cluster-ip-range=" + ServiceCIDR,
		"--advertise-address=" + cp.IP.String(),
		"--profiling=false",
		// Privileged containers, as kubeadm's API server allows them (kube-proxy's DaemonSet
		// and the conntrack init container of deploy/ are privileged).
		"--allow-privileged=true",
	}
	args = append([]string{apiserverBin}, args...)
	c.APIServer = cp.Start(t, append(args, opts.APIServerArgs...)...)

	c.RESTConfig = &rest.Config{
		Host:            c.URL,
		BearerToken:     c.AdminToken,
		TLSClientConfig: rest.TLSClientConfig{Insecure: true},
		Dial:            cp.DialContext,
		QPS:             100,
		Burst:           200,
	}
	client, err := kubernetes.NewForConfig(c.RESTConfig)
	if err != nil {
		t.Fatalf("cluster: client: %v", err)
	}
	c.Client = client

	ctx, cancel := context.WithTimeout(context.Background(), opts.readyTimeout())
	defer cancel()
	if err := c.waitReady(ctx); err != nil {
		t.Fatalf("cluster: %v", err)
	}
	return c
}

// writeFiles writes the service-account key pair, the token file and the admin kubeconfig.
func (c *Cluster) writeFiles() error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("generate service-account key: %w", err)
	}
	priv, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return fmt.Errorf("encode service-account key: %w", err)
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return fmt.Errorf("encode service-account public key: %w", err)
	}
	files := []struct {
		name string
		data []byte
	}{
		{"sa.key", pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: priv})},
		{"sa.pub", pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub})},
		{"tokens.csv", []byte(c.AdminToken + "," + adminUser + "," + adminUser + ",system:masters\n")},
		{"admin.kubeconfig", kubeconfig(c.URL, c.AdminToken)},
	}
	for _, f := range files {
		if err := os.WriteFile(filepath.Join(c.dir, f.name), f.data, 0o600); err != nil {
			return fmt.Errorf("write %s: %w", f.name, err)
		}
	}
	c.Kubeconfig = filepath.Join(c.dir, "admin.kubeconfig")
	return nil
}

// kubeconfig returns a kubeconfig for server with a bearer token, skipping TLS verification.
func kubeconfig(server, token string) []byte {
	return fmt.Appendf(nil, `apiVersion: v1
kind: Config
clusters:
- name: kup
  cluster:
    server: %q
    insecure-skip-tls-verify: true
users:
- name: kup
  user:
    token: %q
contexts:
- name: kup
  context:
    cluster: kup
    user: kup
current-context: kup
`, server, token)
}

// waitReady polls /readyz and the "default" namespace until both answer, failing early with the
// logs if etcd or the API server exits.
func (c *Cluster) waitReady(ctx context.Context) error {
	var last error
	for {
		select {
		case <-c.Etcd.Done():
			return fmt.Errorf("etcd exited (%v) before the API server was ready; log:\n%s", c.Etcd.Err(), c.Etcd.Tail(30))
		case <-c.APIServer.Done():
			return fmt.Errorf("kube-apiserver exited (%v) before it was ready; log:\n%s", c.APIServer.Err(), c.APIServer.Tail(30))
		default:
		}
		last = c.ready(ctx)
		if last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("API server %s not ready: %w (last: %v); kube-apiserver log:\n%s", c.URL, ctx.Err(), last, c.APIServer.Tail(30))
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// ready checks once whether the API server is ready to serve tests.
func (c *Cluster) ready(ctx context.Context) error {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	body, err := c.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(rctx)
	if err != nil {
		return fmt.Errorf("GET /readyz: %w: %s", err, body)
	}
	// /readyz answers before the system namespaces and the "kubernetes" Service exist.
	for _, ns := range []string{metav1.NamespaceDefault, metav1.NamespaceSystem} {
		if _, err := c.Client.CoreV1().Namespaces().Get(rctx, ns, metav1.GetOptions{}); err != nil {
			return fmt.Errorf("get namespace %s: %w", ns, err)
		}
	}
	if _, err := c.Client.CoreV1().Services(metav1.NamespaceDefault).Get(rctx, "kubernetes", metav1.GetOptions{}); err != nil {
		return fmt.Errorf("get service default/kubernetes: %w", err)
	}
	return nil
}

// CreateNode creates a Node object named name with InternalIP internalIP in its status, as
// upstream kube-proxy needs before it programs rules (it waits for its Node, named as its
// --hostname-override, and takes the node IP from it).
func (c *Cluster) CreateNode(ctx context.Context, name string, internalIP netip.Addr) (*corev1.Node, error) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{
		Name:   name,
		Labels: map[string]string{corev1.LabelHostname: name},
	}}
	created, err := c.Client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create node %s: %w", name, err)
	}
	created.Status.Addresses = []corev1.NodeAddress{
		{Type: corev1.NodeInternalIP, Address: internalIP.String()},
		{Type: corev1.NodeHostName, Address: name},
	}
	updated, err := c.Client.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("set addresses of node %s: %w", name, err)
	}
	return updated, nil
}

// KubeProxy starts upstream kube-proxy in iptables mode inside node, as the Node nodeName (create
// it first with [Cluster.CreateNode]), and waits until it has programmed the cluster's services
// once (its metric kubeproxy_sync_proxy_rules_last_timestamp_seconds, served on
// 127.0.0.1:10249 inside node, is set; /healthz says ok earlier than that). extraArgs are
// appended (later flags win; keep the metrics address). Settings that are not per network
// namespace (conntrack table size, OOM score) are left alone. The process is killed in
// t.Cleanup; it fails the test on error.
func (c *Cluster) KubeProxy(t testing.TB, node *netns.NS, nodeName string, extraArgs ...string) *netns.Process {
	t.Helper()
	return c.KubeProxyWithin(t, node, nodeName, 60*time.Second, extraArgs...)
}

// KubeProxyWithin is KubeProxy waiting up to timeout for the first sync (at tens of thousands
// of endpoints, a restarted kube-proxy's first sync takes minutes on a busy machine).
func (c *Cluster) KubeProxyWithin(t testing.TB, node *netns.NS, nodeName string, timeout time.Duration, extraArgs ...string) *netns.Process {
	t.Helper()
	args := []string{
		binary(t, c.binDir, binKubeProxy),
		"--kubeconfig=" + c.Kubeconfig,
		"--proxy-mode=iptables",
		"--hostname-override=" + nodeName,
		"--cluster-cidr=" + c.Network.ClusterCIDR().String(),
		// 0 means "leave as is": the conntrack table size is global, not per namespace.
		"--conntrack-max-per-core=0",
		"--conntrack-tcp-timeout-established=0",
		"--conntrack-tcp-timeout-close-wait=0",
		"--oom-score-adj=0",
		"--healthz-bind-address=0.0.0.0:" + strconv.Itoa(KubeProxyHealthzPort),
		"--metrics-bind-address=" + kubeProxyMetricsAddr,
	}
	p := node.Start(t, append(args, extraArgs...)...)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := waitSynced(ctx, node, p); err != nil {
		t.Fatalf("cluster: kube-proxy for node %s in %s: %v", nodeName, node, err)
	}
	return p
}

// kubeProxyMetricsAddr is where KubeProxy has kube-proxy serve metrics, inside its namespace.
const kubeProxyMetricsAddr = "127.0.0.1:10249"

// syncedMetric is set by kube-proxy after each successful sync of its rules; the first one
// comes only once it has seen all Services and EndpointSlices.
const syncedMetric = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"

// waitSynced polls kube-proxy's metrics inside node until they show a completed sync.
func waitSynced(ctx context.Context, node *netns.NS, p *netns.Process) error {
	hc := &http.Client{Transport: &http.Transport{DialContext: node.DialContext, DisableKeepAlives: true}}
	defer hc.CloseIdleConnections()
	url := "http://" + kubeProxyMetricsAddr + "/metrics"
	var last error
	for {
		select {
		case <-p.Done():
			return fmt.Errorf("exited (%v); log:\n%s", p.Err(), p.Tail(30))
		default:
		}
		var body []byte
		body, last = get(ctx, hc, url)
		if last == nil {
			last = checkSynced(body)
			if last == nil {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("no completed sync: %w (last: %v); log:\n%s", ctx.Err(), last, p.Tail(30))
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// checkSynced returns nil if the Prometheus text metrics show a sync timestamp for every IP
// family kube-proxy reports (samples look like name{ip_family="IPv4"} 1.7e+09).
func checkSynced(metrics []byte) error {
	samples := 0
	for _, line := range strings.Split(string(metrics), "\n") {
		if !strings.HasPrefix(line, syncedMetric) {
			continue
		}
		rest := line[len(syncedMetric):]
		if !strings.HasPrefix(rest, "{") && !strings.HasPrefix(rest, " ") {
			continue // another metric whose name starts the same
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			return fmt.Errorf("metric %s: no value in %q", syncedMetric, line)
		}
		v, err := strconv.ParseFloat(fields[len(fields)-1], 64)
		if err != nil {
			return fmt.Errorf("metric %s: %w", syncedMetric, err)
		}
		if v <= 0 {
			return fmt.Errorf("metric %s: not synced yet: %q", syncedMetric, line)
		}
		samples++
	}
	if samples == 0 {
		return fmt.Errorf("metric %s not reported yet", syncedMetric)
	}
	return nil
}

// get fetches url and returns the body, or an error unless it answers 200.
func get(ctx context.Context, hc *http.Client, url string) ([]byte, error) {
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return nil, fmt.Errorf("GET %s: read body: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s: %.200s", url, resp.Status, body)
	}
	return body, nil
}

// Token returns a bearer token for the ServiceAccount namespace/name, creating the account
// if it does not exist. It grants nothing by itself: bind roles to
// system:serviceaccount:<namespace>:<name> as the test needs.
func (c *Cluster) Token(ctx context.Context, namespace, name string) (string, error) {
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name}}
	_, err := c.Client.CoreV1().ServiceAccounts(namespace).Create(ctx, sa, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("create service account %s/%s: %w", namespace, name, err)
	}
	req := &authenticationv1.TokenRequest{}
	resp, err := c.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, req, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("request token for service account %s/%s: %w", namespace, name, err)
	}
	return resp.Status.Token, nil
}

// KubeconfigFor writes a kubeconfig like [Cluster.Kubeconfig] but with token (from
// [Cluster.Token], say) and returns its path, in the test's temporary directory.
func (c *Cluster) KubeconfigFor(t testing.TB, token string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, kubeconfig(c.URL, token), 0o600); err != nil {
		t.Fatalf("cluster: write kubeconfig: %v", err)
	}
	return path
}

// RESTConfigFor returns a configuration like [Cluster.RESTConfig] with token instead of the
// admin token.
func (c *Cluster) RESTConfigFor(token string) *rest.Config {
	cfg := rest.CopyConfig(c.RESTConfig)
	cfg.BearerToken = token
	return cfg
}

// randomHex returns n random bytes, hex-encoded.
func randomHex(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("read random bytes: %w", err)
	}
	return hex.EncodeToString(b), nil
}
