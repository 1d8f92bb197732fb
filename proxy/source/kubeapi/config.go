package kubeapi

import (
	"fmt"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// UserAgent is the User-Agent BuildConfig sets when the kubeconfig does not set one.
const UserAgent = "kube-userspace-proxy"

// BuildConfig returns the API client configuration for kube-proxy's --kubeconfig and --master
// flags: the kubeconfig file when given (its current context), with its server replaced by
// master when that is given too; master alone (no credentials); and the in-cluster
// configuration (service account token, KUBERNETES_SERVICE_HOST) when both are empty.
//
// Like kube-proxy, it asks for protobuf (with JSON as fallback), which is cheaper to decode.
func BuildConfig(kubeconfig, master string) (*rest.Config, error) {
	var (
		cfg *rest.Config
		err error
	)
	if kubeconfig == "" && master == "" {
		cfg, err = rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("build API client config: neither --kubeconfig nor --master given and in-cluster config unavailable: %w", err)
		}
	} else {
		cfg, err = clientcmd.BuildConfigFromFlags(master, kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("build API client config (kubeconfig %q, master %q): %w", kubeconfig, master, err)
		}
	}
	if cfg.UserAgent == "" {
		cfg.UserAgent = UserAgent
	}
	cfg.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	return cfg, nil
}
