//go:build cluster

// Package kcluster runs kube-userspace-proxy as users deploy it: deploy/ applied with kubectl
// (through the overlay hack/cluster/deploy, which sets the image and the API server) to the real
// three-node cluster of hack/cluster.sh, with real kubelets, containerd, controllers and pods,
// and checks services, rollouts, restarts and drains under traffic.
//
// The cluster must be up (make cluster; make test-cluster brings it up and down). The tests run
// in file order and share the cluster: the DaemonSet first, then a kup-echo Deployment behind
// services, then what disturbs them.
//
//	go test -race -tags cluster ./test/kcluster/
package kcluster

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
)

// The cluster's fixed addresses (hack/cluster.sh).
const (
	clientIP = "10.77.0.100"
	lbIP     = "10.77.1.10" // the Cluster-policy LoadBalancer's IP, routed by the client to node-1
	lbLocal  = "10.77.1.11" // the Local-policy one
)

var nodes = []string{"node-1", "node-2", "node-3"}

func nodeIP(n string) string { return "10.77.0.1" + strings.TrimPrefix(n, "node-") }

// env is what every test shares: the repository, the cluster's kubeconfig, the pinned kubectl
// and a client.
var env struct {
	root       string
	kubeconfig string
	kubectl    string // the pinned kubectl (make test-bins), not one on PATH
	state      string // the cluster's state directory (containerd sockets, logs)
	client     *kubernetes.Clientset
}

func TestMain(m *testing.M) {
	if err := setup(); err != nil {
		fmt.Fprintln(os.Stderr, "kcluster:", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

func setup() error {
	_, file, _, _ := runtime.Caller(0)
	env.root = filepath.Join(filepath.Dir(file), "..", "..")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := run(ctx, nil, filepath.Join(env.root, "hack", "cluster.sh"), "kubeconfig")
	if err != nil {
		return fmt.Errorf("the cluster is not up (make cluster, or make test-cluster which brings it up): %w", err)
	}
	env.kubeconfig = strings.TrimSpace(out)
	env.state = filepath.Dir(env.kubeconfig)
	bin, err := cluster.DefaultBinDir()
	if err != nil {
		return err
	}
	env.kubectl = filepath.Join(bin, "kubectl")
	if _, err := os.Stat(env.kubectl); err != nil {
		return fmt.Errorf("the pinned kubectl (make test-bins): %w", err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", env.kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig %s: %w", env.kubeconfig, err)
	}
	cfg.Timeout = 30 * time.Second
	if env.client, err = kubernetes.NewForConfig(cfg); err != nil {
		return fmt.Errorf("client from %s: %w", env.kubeconfig, err)
	}
	return nil
}

// run runs a command and returns its standard output; the error includes its standard error.
func run(ctx context.Context, stdin []byte, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+env.kubeconfig)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

// kubectl runs kubectl on the cluster, failing the test on error; at most timeout long.
func kubectl(t testing.TB, timeout time.Duration, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out, err := run(ctx, nil, env.kubectl, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// kubectlApply applies YAML.
func kubectlApply(t testing.TB, yaml string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := run(ctx, []byte(yaml), env.kubectl, "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
}

// clusterName is the prefix of the cluster's namespaces (hack/cluster.sh's KUP_CLUSTER_NAME).
func clusterName() string {
	if n := os.Getenv("KUP_CLUSTER_NAME"); n != "" {
		return n
	}
	return "kupc"
}

// clusterSh runs hack/cluster.sh.
func clusterSh(ctx context.Context, args ...string) (string, error) {
	return run(ctx, nil, filepath.Join(env.root, "hack", "cluster.sh"), args...)
}

// onNode runs a command in a node's namespaces (hack/cluster.sh exec).
func onNode(ctx context.Context, node string, args ...string) (string, error) {
	return clusterSh(ctx, append([]string{"exec", node}, args...)...)
}

// waitFor polls check every interval until it returns nil or timeout passes; it fails the test
// with check's last error.
func waitFor(t testing.TB, timeout, interval time.Duration, what string, check func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := check()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v: %v", what, timeout, err)
		}
		time.Sleep(interval)
	}
}
