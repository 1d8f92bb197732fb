package cluster

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
)

// The pinned versions of the real components. They must agree with test/k8sbin/go.mod and the
// top of test/cluster.mk (TestPinsAgree checks both); test/k8sbin/pin.sh changes the go.mod.
const (
	// KubernetesVersion is the k8s.io/kubernetes release kube-apiserver and kube-proxy are
	// built from.
	KubernetesVersion = "v1.36.3"
	// EtcdVersion is the go.etcd.io/etcd/server/v3 release etcd is built from.
	EtcdVersion = "v3.6.8"
)

// Names of the binaries in the binary directory.
const (
	binAPIServer = "kube-apiserver"
	binKubeProxy = "kube-proxy"
	binEtcd      = "etcd"
)

// BinDirEnv is the environment variable that, when set, names the directory holding
// kube-apiserver, kube-proxy and etcd instead of the default cache directory.
const BinDirEnv = "KUP_K8S_BIN"

// DefaultBinDir returns where `make test-bins` puts the binaries of the pinned versions unless
// KUP_K8S_BIN says otherwise: $XDG_CACHE_HOME (or ~/.cache)/kube-userspace-proxy/bin/
// k8s-<KubernetesVersion>-etcd-<EtcdVersion>.
func DefaultBinDir() (string, error) {
	if dir := os.Getenv(BinDirEnv); dir != "" {
		return dir, nil
	}
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("find binary directory: no %s, XDG_CACHE_HOME or home directory: %w", BinDirEnv, err)
		}
		cache = filepath.Join(home, ".cache")
	}
	return filepath.Join(cache, "kube-userspace-proxy", "bin", "k8s-"+KubernetesVersion+"-etcd-"+EtcdVersion), nil
}

// binary returns the path of the named binary in dir ("" means [DefaultBinDir]). When it is
// missing it skips the test with instructions, and under KUP_TEST_ALL=1 (make test, CI) fails
// it: tests need the real thing (see package internal/testenv).
func binary(t testing.TB, dir, name string) string {
	t.Helper()
	if dir == "" {
		var err error
		if dir, err = DefaultBinDir(); err != nil {
			t.Fatalf("cluster: %v", err)
		}
	}
	path := filepath.Join(dir, name)
	fi, err := os.Stat(path)
	if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		testenv.Need(t, fmt.Sprintf("cluster: %s (Kubernetes %s, etcd %s), not found as an executable at %s: run `make test-bins` "+
			"to build it (a few minutes once, then cached), or set %s to a directory holding kube-apiserver, kube-proxy and etcd",
			name, KubernetesVersion, EtcdVersion, path, BinDirEnv))
	}
	return path
}
