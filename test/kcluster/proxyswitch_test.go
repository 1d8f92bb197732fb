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

// nftTables returns a node's nftables tables ("ip kube-proxy", "ip nat", ...), one a line.
func nftTables(ctx context.Context, node string) (string, error) {
	return onNode(ctx, node, "nft", "list", "tables")
}

// serviceProxies returns the service proxies' DaemonSets in kube-system.
func serviceProxies(t testing.TB) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	list, err := env.client.AppsV1().DaemonSets(proxyNS).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, ds := range list.Items {
		out = append(out, ds.Name)
	}
	return out
}

// TestSwitchProxy: `hack/cluster.sh proxy NAME` makes upstream kube-proxy in iptables mode, then
// in nftables mode, then kube-userspace-proxy the cluster's only service proxy: after each switch
// only NAME's DaemonSet is there, no node holds the previous proxy's rules and every node holds
// NAME's, the echo Service answers by ClusterIP from every node with every backend, and a pod
// resolves it (over UDP and TCP, to the kube-dns Service that NAME now serves) and reaches it by
// name.
func TestSwitchProxy(t *testing.T) {
	workload(t)
	waitCoreDNS(t)
	type rules struct {
		iptables, portals, nftables bool // KUBE-SERVICES, KUBE-PORTALS-CONTAINER, table ip kube-proxy
	}
	steps := []struct {
		name, ds string
		want     rules
	}{
		{"kube-proxy-iptables", "kube-proxy", rules{iptables: true}},
		{"kube-proxy-nftables", "kube-proxy", rules{nftables: true}},
		{"kube-userspace-proxy", proxyName, rules{portals: true}},
	}
	back := false
	defer func() {
		if back {
			return
		}
		// A failed step: the other tests (and a kept cluster) want this project's proxy.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		if _, err := clusterSh(ctx, "proxy", "kube-userspace-proxy"); err != nil {
			t.Errorf("switching back to kube-userspace-proxy: %v", err)
		}
	}()
	for _, s := range steps {
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		out, err := clusterSh(ctx, "proxy", s.name)
		cancel()
		if err != nil {
			t.Fatalf("hack/cluster.sh proxy %s: %v\n%s", s.name, err, out)
		}
		t.Logf("hack/cluster.sh proxy %s: %v", s.name, time.Since(start).Round(100*time.Millisecond))
		if got := serviceProxies(t); strings.Join(got, " ") != s.ds {
			t.Errorf("after the switch to %s the DaemonSets of kube-system are %v, want only %s", s.name, got, s.ds)
		}
		ctx, cancel = context.WithTimeout(context.Background(), time.Minute)
		for _, n := range nodes {
			nat, err := natRules(ctx, n)
			if err != nil {
				t.Fatal(err)
			}
			tables, err := nftTables(ctx, n)
			if err != nil {
				t.Fatal(err)
			}
			got := rules{
				iptables: strings.Contains(nat, ":KUBE-SERVICES"),
				portals:  strings.Contains(nat, ":KUBE-PORTALS-CONTAINER"),
				nftables: strings.Contains(tables, "table ip kube-proxy"),
			}
			if got != s.want {
				t.Errorf("%s with %s: KUBE-SERVICES %v, KUBE-PORTALS-CONTAINER %v, nft table ip kube-proxy %v; want %v, %v, %v",
					n, s.name, got.iptables, got.portals, got.nftables, s.want.iptables, s.want.portals, s.want.nftables)
			}
		}
		cancel()
		backends := echoPods(t)
		for _, n := range nodes {
			// The new proxy may still be programming the service after its pod turned Ready.
			waitFor(t, 30*time.Second, 500*time.Millisecond, fmt.Sprintf("the echo ClusterIP from %s with %s", n, s.name), func() error {
				got := map[string]bool{}
				for range 12 {
					name, _, err := where(n).ask(wl.clusterIP, 2*time.Second)
					if err != nil {
						return err
					}
					got[name] = true
				}
				for _, names := range backends {
					for _, name := range names {
						if !got[name] {
							return fmt.Errorf("%s did not answer (answers from %v)", name, got)
						}
					}
				}
				return nil
			})
		}
		t.Run(s.name, checkDNS)
		if t.Failed() {
			return
		}
	}
	back = true
}
