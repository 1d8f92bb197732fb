//go:build cluster

package kcluster

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// dnsIP is the kube-dns Service's ClusterIP, the kubelets' clusterDNS (hack/cluster.sh).
const dnsIP = "10.96.0.10"

// clusterIPOf returns a Service's ClusterIP.
func clusterIPOf(t testing.TB, ns, name string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := env.client.CoreV1().Services(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return s.Spec.ClusterIP
}

// waitCoreDNS waits until CoreDNS (applied by hack/cluster.sh up) has both replicas Ready behind
// the kube-dns Service.
func waitCoreDNS(t testing.TB) {
	t.Helper()
	if ip := clusterIPOf(t, "kube-system", "kube-dns"); ip != dnsIP {
		t.Fatalf("the kube-dns Service's ClusterIP is %s, want %s (the kubelets' clusterDNS)", ip, dnsIP)
	}
	waitFor(t, 2*time.Minute, time.Second, "CoreDNS Ready", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		d, err := env.client.AppsV1().Deployments("kube-system").Get(ctx, "coredns", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if d.Status.ReadyReplicas != 2 || d.Status.UpdatedReplicas != 2 {
			return fmt.Errorf("CoreDNS: %d ready, %d updated of 2", d.Status.ReadyReplicas, d.Status.UpdatedReplicas)
		}
		return nil
	})
}

// resolveIn looks name up from a pod of the kup-e2e namespace over network ("udp" or "tcp"),
// with the pod's own resolv.conf (the kubelet's clusterDNS and search list).
func resolveIn(pod, network, name string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := run(ctx, nil, env.kubectl, "-n", echoNS, "exec", pod, "--", "/kup-echo", "resolve", "--"+network, name)
	return strings.TrimSpace(out), err
}

// checkDNS: from a pod, over UDP and over TCP, the cluster's names resolve to their Services'
// ClusterIPs (full names, a Service of another namespace, the pod's own namespace's short name),
// a name outside the cluster's zones does not, and the echo Service answers by name.
func checkDNS(t *testing.T) {
	t.Helper()
	backends := echoPods(t)
	pod := backends["node-1"][0]
	want := map[string]string{
		"kubernetes.default.svc.cluster.local":   clusterIPOf(t, "default", "kubernetes"),
		"kube-dns.kube-system.svc.cluster.local": dnsIP,
		"kubernetes.default":                     clusterIPOf(t, "default", "kubernetes"),
		"echo":                                   clusterIPOf(t, echoNS, "echo"),
		"echo-np.kup-e2e.svc":                    clusterIPOf(t, echoNS, "echo-np"),
	}
	for _, network := range []string{"udp", "tcp"} {
		for name, ip := range want {
			got, err := resolveIn(pod, network, name)
			if err != nil {
				t.Errorf("pod %s: %s over %s: %v", pod, name, network, err)
			} else if got != ip {
				t.Errorf("pod %s: %s over %s is %q, want %s", pod, name, network, got, ip)
			}
		}
		// Nothing to forward to: CoreDNS refuses names outside the cluster's zones.
		if got, err := resolveIn(pod, network, "example.com."); err == nil {
			t.Errorf("pod %s: example.com. over %s resolved to %q, want an error (refused)", pod, network, got)
		}
	}
	// The Service by name, through the cluster's DNS and then its proxy.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := run(ctx, nil, env.kubectl, "-n", echoNS, "exec", pod, "--", "/kup-echo", "request", "--tcp", "echo:80", "--count", "30")
	if err != nil {
		t.Fatalf("the echo Service by name from pod %s: %v", pod, err)
	}
	got := map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if f := strings.Fields(line); len(f) == 2 {
			got[f[0]]++
		}
	}
	wantAll(t, "echo:80 from pod "+pod, got, backends)
}

// TestClusterDNS: CoreDNS, deployed by make cluster behind the kube-dns Service that the proxy
// serves, answers a pod's queries over UDP and over TCP, and the pod reaches a Service by name.
func TestClusterDNS(t *testing.T) {
	workload(t)
	waitCoreDNS(t)
	checkDNS(t)
}
