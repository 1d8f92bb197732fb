//go:build linux && bench

package bench

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// outsidePath is one path of the outside-client table: the NodePorts of the Local
// service on a node whose own pod is the only local endpoint.
type outsidePath struct {
	path string
	node *netns.Node
	pod  *netns.Pod
	// name is the node's (and, with "server-" in front, its pod's) name.
	name string
	// tcp, udp and iperf are node IP:NodePort of the echo TCP, echo UDP and iperf3 TCP ports.
	tcp, udp, iperf string
	// seesClient: the pod must see the outside client's address (else a node address).
	seesClient bool
	// stop ends the proxy of the node.
	stop func()
}

// outside is the outside-client setup: the client and one node per path.
type outside struct {
	// client is the current outside client; runOutside takes a fresh one (from clients) per
	// repetition: kup-load closes first, so each short-connection run leaves thousands of
	// TIME_WAIT sockets in the client for 60 s, and the next run to the same node would spend
	// its time finding free ports (seen: iptables 7084 conn/s in the first repetition, 1142 in
	// the next two).
	client  *netns.Host
	clients []*netns.Host
	paths   map[string]outsidePath
}

// setupOutside adds an outside client and, per OutsidePaths entry, a node with a server pod
// (kup-echo, iperf3 -s) and its proxy: kube-proxy in iptables mode, kube-userspace-proxy with
// --transparent-local=true and =false. One NodePort service with externalTrafficPolicy: Local
// has the three pods as endpoints, each on its own node, so each node forwards to its own pod.
func setupOutside(ctx context.Context, t *testing.T, n *netns.Network, c *cluster.Cluster, reps int) *outside {
	t.Helper()
	o := &outside{paths: map[string]outsidePath{}}
	for i := range reps {
		o.clients = append(o.clients, n.AddClient(t, fmt.Sprintf("outside%d", i)))
	}
	o.client = o.clients[0]
	names := map[string]string{PathIPTables: "iptl", PathTransparent: "kupt", PathPlain: "kupp"}
	var eps []harness.Endpoint
	for _, p := range OutsidePaths {
		op := outsidePath{path: p, name: names[p], seesClient: p != PathPlain}
		op.node = n.AddNode(t, op.name)
		op.pod = n.AddPod(t, op.node, "server")
		harness.StartEcho(t, op.pod.NS, "server-"+op.name, echoPort)
		op.pod.NS.Start(t, "iperf3", "-s", "-p", strconv.Itoa(iperfPort))
		if _, err := c.CreateNode(ctx, op.name, op.node.IP); err != nil {
			t.Fatalf("create node %s: %v", op.name, err)
		}
		eps = append(eps, harness.Endpoint{IP: op.pod.IP, Node: op.name, Name: "server-" + op.name})
		o.paths[p] = op
	}
	s := harness.NodePortService("outside", harness.TCPPort("echo", 80, echoPort), harness.UDPPort("echo-udp", 80, echoPort),
		harness.TCPPort("iperf", iperfPort, iperfPort))
	s.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	svc := harness.CreateService(ctx, t, c.Client, s)
	harness.ApplySlice(ctx, t, c.Client, harness.Slice(svc, eps...))

	for _, p := range OutsidePaths {
		op := o.paths[p]
		op.tcp, op.udp, op.iperf = harness.NodePortAddr(op.node.IP, svc, 0), harness.NodePortAddr(op.node.IP, svc, 1), harness.NodePortAddr(op.node.IP, svc, 2)
		if p == PathIPTables {
			kp := c.KubeProxy(t, op.node.NS, op.name)
			op.stop = kp.Stop
		} else {
			kup := harness.StartProxy(t, op.node.NS, harness.ProxyConfig{NodeName: op.name, Kubeconfig: c.Kubeconfig, LogLevel: "info",
				Args: []string{"--nodeport-addresses=" + n.Subnet().String(), "--transparent-local=" + strconv.FormatBool(p == PathTransparent)},
				Ready: func(ctx context.Context) error {
					_, err := harness.Ask(ctx, o.client.NS, "tcp", op.tcp)
					return err
				}})
			op.stop = func() {
				if err := kup.Terminate(30 * time.Second); err != nil {
					t.Logf("stop kube-userspace-proxy on %s: %v", op.name, err)
				}
			}
		}
		o.paths[p] = op
	}
	harness.WaitFor(t, 30*time.Second, func() error { return o.verify(ctx) })
	return o
}

// verify asks every path over TCP and UDP from the outside client and checks that the node's
// own pod answered and saw the client's address (transparent, iptables) or a node address
// (plain).
func (o *outside) verify(ctx context.Context) error {
	for _, p := range OutsidePaths {
		op := o.paths[p]
		for nw, addr := range map[string]string{"tcp": op.tcp, "udp": op.udp} {
			a, err := harness.Ask(ctx, o.client.NS, nw, addr)
			if err != nil {
				return fmt.Errorf("outside client → %s (%s %s): %w", p, nw, addr, err)
			}
			if want := "server-" + op.name; a.Backend != want {
				return fmt.Errorf("outside client → %s (%s %s): answered by %q, want the node's own pod %q", p, nw, addr, a.Backend, want)
			}
			if err := op.checkPeer(a.Peer.Addr(), o.client.IP); err != nil {
				return fmt.Errorf("outside client → %s (%s %s): %w", p, nw, addr, err)
			}
		}
	}
	return nil
}

// checkPeer says whether peer, as the pod saw it, is what the path must show.
func (op outsidePath) checkPeer(peer, client netip.Addr) error {
	if op.seesClient {
		if peer != client {
			return fmt.Errorf("the pod saw %v, want the outside client's %v (not transparent)", peer, client)
		}
		return nil
	}
	if peer == client || !op.node.PodCIDR.Contains(peer) && peer != op.node.IP {
		return fmt.Errorf("the pod saw %v, want a node address (%v or in %v), not the client's %v", peer, op.node.IP, op.node.PodCIDR, client)
	}
	return nil
}

// runOutside measures the outside-client paths: per repetition, per workload, every path in
// turn (the order rotating each repetition). The addresses the pods see are checked before and
// after; a wrong one fails the run.
func runOutside(t *testing.T, rep *Report, cfg settings, o *outside, loadBin string) {
	ctx := context.Background()
	secs := fmt.Sprint(cfg.loadDuration)
	for r := range cfg.reps {
		o.client = o.clients[r%len(o.clients)]
		if err := o.verify(ctx); err != nil {
			t.Fatalf("before outside repetition %d: %v", r+1, err)
		}
		order := append(append([]string{}, OutsidePaths[r%len(OutsidePaths):]...), OutsidePaths[:r%len(OutsidePaths)]...)
		each := func(fn func(op outsidePath)) {
			for _, p := range order {
				fn(o.paths[p])
			}
		}
		m := rep.OutsideMetric("bulk TCP, 1 stream", "Gbit/s", true)
		each(func(op outsidePath) {
			v, err := iperf(o.client.NS, op.iperf, 1, false, cfg.iperfArgs)
			record(t, m, op.path, v/1e9, err)
		})
		m = rep.OutsideMetric("short connections", "conn/s", true)
		each(func(op outsidePath) {
			res, err := load(o.client.NS, loadBin, "conn", op.tcp, "--duration", secs, "--concurrency", "4", "--max", "200000")
			record(t, m, op.path, res.Rate, err)
		})
		m = rep.OutsideMetric("UDP 64-byte req/resp", "req/s", true)
		each(func(op outsidePath) {
			res, err := load(o.client.NS, loadBin, "udprr", op.udp, "--duration", secs, "--concurrency", "4", "--size", "64")
			record(t, m, op.path, res.Rate, err)
		})
		if err := o.verify(ctx); err != nil {
			t.Fatalf("after outside repetition %d: %v", r+1, err)
		}
		t.Logf("outside-client repetition %d/%d done (load %s)", r+1, cfg.reps, loadavg())
	}
	seen := map[string]string{}
	for _, p := range OutsidePaths {
		a, err := harness.Ask(ctx, o.client.NS, "tcp", o.paths[p].tcp)
		if err != nil {
			t.Fatalf("outside client → %s: %v", p, err)
		}
		seen[p] = a.Peer.Addr().String()
	}
	rep.OutsideNotes = append(rep.OutsideNotes,
		fmt.Sprintf("An outside client (%v, a host on the nodes' bridge, not in the cluster; a fresh one per repetition so that the TIME_WAIT sockets of one repetition's short connections do not slow the next) connects to the NodePort of one externalTrafficPolicy: Local service on three nodes, "+
			"each with its own server pod (kup-echo, iperf3 -s) as the service's only local endpoint: iptables = upstream kube-proxy v1.36.3 --proxy-mode=iptables; "+
			"userspace transparent = kube-userspace-proxy --transparent-local=true (dials the pod from the client's address: IP_TRANSPARENT + policy routing); "+
			"userspace plain = kube-userspace-proxy --transparent-local=false (dials from the node). Each proxy on its own node, the three paths interleaved per repetition, the order rotating.", o.client.IP),
		fmt.Sprintf("Checked in the run, before and after every repetition, over TCP and UDP: the node's own pod answers, and sees the client's address through iptables and transparent, a node address through plain "+
			"(seen over TCP: iptables %s, transparent %s, plain %s); a wrong address fails the run.", seen[PathIPTables], seen[PathTransparent], seen[PathPlain]),
		fmt.Sprintf("Workloads as in the main table: iperf3 (%v) 1 stream; kup-load conn (4 workers, one request per new TCP connection, %v); kup-load udprr (4 sockets, 64-byte requests, %v). "+
			"Ratios to iptables mode per cell; the last column is transparent's median over plain's.", strings.Join(cfg.iperfArgs, " "), cfg.loadDuration, cfg.loadDuration),
	)
}
