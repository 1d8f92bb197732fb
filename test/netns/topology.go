//go:build linux

package netns

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"sync"
	"testing"
)

// The addressing plan. It exists only inside the test's namespaces.
var (
	bridgeSubnet  = netip.MustParsePrefix("10.0.0.0/24") // nodes and hosts, on the bridge
	bridgeGateway = netip.MustParseAddr("10.0.0.1")      // the network namespace's bridge address
	clusterCIDR   = netip.MustParsePrefix("10.244.0.0/16")

	// The IPv6 half of a dual-stack network (see [NewDualStackNetwork]), mirroring the IPv4 one.
	bridgeSubnet6  = netip.MustParsePrefix("fd00:10::/64")
	bridgeGateway6 = netip.MustParseAddr("fd00:10::1")
	clusterCIDR6   = netip.MustParsePrefix("fd00:244::/56") // node k's pod subnet is fd00:244:0:k::/64
)

const (
	bridgeName = "br0"
	// maxNodes and maxPods follow from the plan: one /24 of 10.244.0.0/16 per node, .1 is the
	// node's side of every pod veth.
	maxNodes = 254
	maxPods  = 253
)

// Network is a small cluster network made of namespaces:
//
//   - a "network" namespace holding bridge br0 with address 10.0.0.1/24, forwarding between its
//     ports and routing every node's pod subnet to that node;
//   - hosts (see [Network.AddHost]) and nodes (see [Network.AddNode]): namespaces with an eth0 on
//     the bridge, addresses 10.0.0.2, 10.0.0.3, … in creation order, default route via 10.0.0.1;
//   - nodes additionally forward (ip_forward=1) and get pod subnet 10.244.<k>.0/24, k = 1, 2, …;
//     every other node has a route to it via the node's address;
//   - pods (see [Network.AddPod]): namespaces with an eth0 whose peer sits in their node, pod
//     address 10.244.<k>.2, .3, … /32, default route via 10.244.<k>.1 (the address of the node's
//     side of every pod veth), and a /32 route on the node; a bridged pod's peer is a port of
//     the node's bridge cbr0 instead (see [Network.AddBridgedPod]), which holds 10.244.<k>.1.
//
// So every pod reaches every pod and node directly, and hosts reach pods through the network
// namespace. Methods may be called from several goroutines; topology changes are serialised.
//
// A network made by [NewDualStackNetwork] has the same plan in IPv6 as well: bridge address
// fd00:10::1/64; hosts and nodes fd00:10::<n> (n the last octet of their IPv4 address); node k's
// pod subnet fd00:244:0:k::/64, whose ::1 is the node's side of every pod veth; pods
// fd00:244:0:k::<n>/128 (n the last octet of their IPv4 address). Nodes and the network namespace
// forward IPv6 too. Duplicate address detection is off in its namespaces, so IPv6 addresses are
// usable at once.
type Network struct {
	// NS is the network namespace holding the bridge.
	NS *NS

	ipv6 bool // dual-stack: every host, node and pod gets an IPv6 address too; set at creation

	mu       sync.Mutex // guards following fields
	lastHost int        // last octet given out on the bridge
	nodes    []*Node
}

// Host is a namespace attached to the network's bridge: an outside client, a control plane, or
// the base of a [Node].
type Host struct {
	*NS
	// IP is the host's address on the bridge (interface eth0).
	IP netip.Addr
	// IPv6 is the host's IPv6 address on the bridge in a dual-stack network; the zero Addr
	// otherwise.
	IPv6 netip.Addr
}

// Node is a host that carries pods.
type Node struct {
	Host
	// PodCIDR is the node's pod subnet.
	PodCIDR netip.Prefix
	// PodCIDRv6 is the node's IPv6 pod subnet in a dual-stack network; the zero Prefix
	// otherwise.
	PodCIDRv6 netip.Prefix

	mu      sync.Mutex // guards lastPod and bridged
	lastPod int        // last octet given out in PodCIDR
	bridged bool       // the pod bridge exists (see Network.AddBridgedPod)
}

// Pod is a namespace attached to a node by a veth pair (eth0 in the pod).
type Pod struct {
	*NS
	// IP is the pod's address, from its node's PodCIDR.
	IP netip.Addr
	// IPv6 is the pod's IPv6 address, from its node's PodCIDRv6, in a dual-stack network; the
	// zero Addr otherwise.
	IPv6 netip.Addr
	// Node is the node the pod is attached to.
	Node *Node
}

// NewNetwork creates the network namespace kup-<name>-<random> with its bridge. Everything is
// deleted in t.Cleanup. It fails the test on error.
func NewNetwork(t testing.TB, name string) *Network {
	t.Helper()
	return newNetwork(t, name, false)
}

// NewDualStackNetwork is [NewNetwork] for a network whose hosts, nodes and pods have an IPv6
// address besides their IPv4 one (see [Network] for the plan).
func NewDualStackNetwork(t testing.TB, name string) *Network {
	t.Helper()
	return newNetwork(t, name, true)
}

func newNetwork(t testing.TB, name string, ipv6 bool) *Network {
	t.Helper()
	n := &Network{NS: New(t, name), lastHost: 1, ipv6: ipv6}
	if ipv6 {
		if err := n.NS.disableDAD(); err != nil {
			t.Fatalf("netns: create network %s: %v", n.NS.name, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	steps := [][]string{
		{"link", "add", bridgeName, "type", "bridge"},
		{"addr", "add", prefixOf(bridgeGateway, bridgeSubnet), "dev", bridgeName},
		{"link", "set", bridgeName, "up"},
	}
	sysctls := [][2]string{
		{"net.ipv4.ip_forward", "1"},
		// Hosts reach pods through us and the replies go straight back over the bridge: do
		// not tell them about the shorter path.
		{"net.ipv4.conf.all.send_redirects", "0"},
		{"net.ipv4.conf." + bridgeName + ".send_redirects", "0"},
	}
	if ipv6 {
		steps = append(steps, []string{"addr", "add", prefixOf(bridgeGateway6, bridgeSubnet6), "dev", bridgeName, "nodad"})
		sysctls = append(sysctls, [2]string{"net.ipv6.conf.all.forwarding", "1"})
	}
	if err := n.NS.ipSteps(ctx, steps); err != nil {
		t.Fatalf("netns: create network %s: %v", n.NS.name, err)
	}
	for _, kv := range sysctls {
		if err := n.NS.SetSysctl(kv[0], kv[1]); err != nil {
			t.Fatalf("netns: create network %s: %v", n.NS.name, err)
		}
	}
	return n
}

// Gateway returns the network namespace's address on the bridge, the default gateway of hosts
// and nodes.
func (n *Network) Gateway() netip.Addr { return bridgeGateway }

// Subnet returns the bridge subnet, which holds the addresses of hosts and nodes.
func (n *Network) Subnet() netip.Prefix { return bridgeSubnet }

// ClusterCIDR returns the prefix all pod subnets are taken from (kube-proxy's --cluster-cidr).
func (n *Network) ClusterCIDR() netip.Prefix { return clusterCIDR }

// DualStack reports whether the network was made by [NewDualStackNetwork].
func (n *Network) DualStack() bool { return n.ipv6 }

// Subnet6 and ClusterCIDR6 are Subnet and ClusterCIDR for IPv6; they are the zero Prefix unless
// the network is dual-stack.
func (n *Network) Subnet6() netip.Prefix {
	if !n.ipv6 {
		return netip.Prefix{}
	}
	return bridgeSubnet6
}

// ClusterCIDR6 is documented with Subnet6.
func (n *Network) ClusterCIDR6() netip.Prefix {
	if !n.ipv6 {
		return netip.Prefix{}
	}
	return clusterCIDR6
}

// Nodes returns the nodes added so far, in order.
func (n *Network) Nodes() []*Node {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]*Node(nil), n.nodes...)
}

// AddHost creates a namespace attached to the bridge, with the next address of the bridge
// subnet on its eth0 and a default route via the network namespace. It fails the test on error.
func (n *Network) AddHost(t testing.TB, name string) *Host {
	t.Helper()
	n.mu.Lock()
	defer n.mu.Unlock()
	h, err := n.addHostLocked(t, name)
	if err != nil {
		t.Fatalf("netns: add host %s: %v", name, err)
	}
	return h
}

// AddClient is [Network.AddHost] for a client outside the cluster; it exists so that call sites
// say what the namespace is for.
func (n *Network) AddClient(t testing.TB, name string) *Host {
	t.Helper()
	return n.AddHost(t, name)
}

func (n *Network) addHostLocked(t testing.TB, name string) (*Host, error) {
	t.Helper()
	if n.lastHost+1 >= 255 {
		return nil, fmt.Errorf("bridge subnet %s is full", bridgeSubnet)
	}
	n.lastHost++
	octet := n.lastHost
	ip := nthAddr(bridgeSubnet, octet)
	h := &Host{NS: New(t, name), IP: ip}
	if n.ipv6 {
		if err := h.disableDAD(); err != nil {
			return nil, err
		}
	}
	port := "p" + strconv.Itoa(octet) // the bridge port in the network namespace
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	if err := ipCmd(ctx, "link", "add", "eth0", "netns", h.name, "type", "veth", "peer", "name", port, "netns", n.NS.name); err != nil {
		return nil, err
	}
	if err := n.NS.ipSteps(ctx, [][]string{
		{"link", "set", port, "master", bridgeName},
		{"link", "set", port, "up"},
	}); err != nil {
		return nil, err
	}
	if err := h.ipSteps(ctx, [][]string{
		{"addr", "add", prefixOf(ip, bridgeSubnet), "dev", "eth0"},
		{"link", "set", "eth0", "up"},
		{"route", "add", "default", "via", bridgeGateway.String()},
	}); err != nil {
		return nil, err
	}
	if n.ipv6 {
		h.IPv6 = nthAddr(bridgeSubnet6, octet)
		if err := h.ipSteps(ctx, [][]string{
			{"addr", "add", prefixOf(h.IPv6, bridgeSubnet6), "dev", "eth0", "nodad"},
			{"-6", "route", "add", "default", "via", bridgeGateway6.String()},
		}); err != nil {
			return nil, err
		}
	}
	return h, nil
}

// AddNode creates a node: a host (see [Network.AddHost]) that forwards, owns the next pod subnet,
// and is routed to by every other node and by the network namespace. It fails the test on
// error.
func (n *Network) AddNode(t testing.TB, name string) *Node {
	t.Helper()
	n.mu.Lock()
	defer n.mu.Unlock()
	node, err := n.addNodeLocked(t, name)
	if err != nil {
		t.Fatalf("netns: add node %s: %v", name, err)
	}
	return node
}

func (n *Network) addNodeLocked(t testing.TB, name string) (*Node, error) {
	t.Helper()
	if len(n.nodes) >= maxNodes {
		return nil, fmt.Errorf("cluster CIDR %s is full", clusterCIDR)
	}
	h, err := n.addHostLocked(t, name)
	if err != nil {
		return nil, err
	}
	k := len(n.nodes) + 1
	base := clusterCIDR.Addr().As4()
	base[2] = byte(k)
	node := &Node{Host: *h, PodCIDR: netip.PrefixFrom(netip.AddrFrom4(base), 24), lastPod: 1}
	if err := node.SetSysctl("net.ipv4.ip_forward", "1"); err != nil {
		return nil, err
	}
	if n.ipv6 {
		base6 := clusterCIDR6.Addr().As16()
		base6[6], base6[7] = byte(k>>8), byte(k)
		node.PodCIDRv6 = netip.PrefixFrom(netip.AddrFrom16(base6), 64)
		if err := node.SetSysctl("net.ipv6.conf.all.forwarding", "1"); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	// routes returns the steps routing to node's pod subnets via node (in IPv6 too when set).
	routes := func(to *Node) [][]string {
		r := [][]string{{"route", "add", to.PodCIDR.String(), "via", to.IP.String()}}
		if to.PodCIDRv6.IsValid() {
			r = append(r, []string{"route", "add", to.PodCIDRv6.String(), "via", to.IPv6.String()})
		}
		return r
	}
	// Addresses of the subnet that are no pod's fail fast instead of looping via the gateway.
	steps := [][]string{{"route", "add", "unreachable", node.PodCIDR.String()}}
	if node.PodCIDRv6.IsValid() {
		steps = append(steps, []string{"route", "add", "unreachable", node.PodCIDRv6.String()})
	}
	for _, other := range n.nodes {
		steps = append(steps, routes(other)...)
		if err := other.ipSteps(ctx, routes(node)); err != nil {
			return nil, err
		}
	}
	if err := node.ipSteps(ctx, steps); err != nil {
		return nil, err
	}
	if err := n.NS.ipSteps(ctx, routes(node)); err != nil {
		return nil, err
	}
	n.nodes = append(n.nodes, node)
	return node, nil
}

// AddPod creates a pod on node: a namespace whose eth0 is a veth to the node, with the node's
// next pod address. It fails the test on error.
func (n *Network) AddPod(t testing.TB, node *Node, name string) *Pod {
	t.Helper()
	pod, err := node.addPod(t, name, false)
	if err != nil {
		t.Fatalf("netns: add pod %s on node %s: %v", name, node.name, err)
	}
	return pod
}

// AddBridgedPod creates a pod on node as [Network.AddPod] does, but with the node's side of its
// veth a port of the node's bridge cbr0 (created with the first such pod; it holds the pod
// gateway address), as CNI bridge plugins attach pods: the pod's packets come in through a
// bridge port, so the physdev match sees them as bridged in. It fails the test on error.
func (n *Network) AddBridgedPod(t testing.TB, node *Node, name string) *Pod {
	t.Helper()
	pod, err := node.addPod(t, name, true)
	if err != nil {
		t.Fatalf("netns: add bridged pod %s on node %s: %v", name, node.name, err)
	}
	return pod
}

// podBridge is the name of a node's bridge for pods (see Network.AddBridgedPod).
const podBridge = "cbr0"

// bridgeLocked creates the node's pod bridge unless it exists.
func (node *Node) bridgeLocked(ctx context.Context) error {
	if node.bridged {
		return nil
	}
	steps := [][]string{
		{"link", "add", podBridge, "type", "bridge"},
		{"addr", "add", nthAddr(node.PodCIDR, 1).String() + "/32", "dev", podBridge},
	}
	if node.PodCIDRv6.IsValid() {
		steps = append(steps, []string{"addr", "add", nthAddr(node.PodCIDRv6, 1).String() + "/128", "dev", podBridge, "nodad"})
	}
	steps = append(steps, []string{"link", "set", podBridge, "up"})
	if err := node.ipSteps(ctx, steps); err != nil {
		return err
	}
	node.bridged = true
	return nil
}

func (node *Node) addPod(t testing.TB, name string, bridged bool) (*Pod, error) {
	t.Helper()
	node.mu.Lock()
	defer node.mu.Unlock()
	if node.lastPod-1 >= maxPods {
		return nil, fmt.Errorf("pod subnet %s is full", node.PodCIDR)
	}
	node.lastPod++
	octet := node.lastPod
	pod := &Pod{NS: New(t, name), IP: nthAddr(node.PodCIDR, octet), Node: node}
	if node.PodCIDRv6.IsValid() {
		if err := pod.disableDAD(); err != nil {
			return nil, err
		}
	}
	gw := nthAddr(node.PodCIDR, 1)
	veth := "v" + strconv.Itoa(octet) // the node's side
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	if err := ipCmd(ctx, "link", "add", "eth0", "netns", pod.name, "type", "veth", "peer", "name", veth, "netns", node.name); err != nil {
		return nil, err
	}
	// The pod's route on the node leads to its veth, or to the bridge the veth is a port of.
	dev := veth
	steps := [][]string{
		{"addr", "add", gw.String() + "/32", "dev", veth},
		{"link", "set", veth, "up"},
	}
	if bridged {
		if err := node.bridgeLocked(ctx); err != nil {
			return nil, err
		}
		dev = podBridge
		steps = [][]string{
			{"link", "set", veth, "master", podBridge},
			{"link", "set", veth, "up"},
		}
	}
	steps = append(steps, []string{"route", "add", pod.IP.String() + "/32", "dev", dev})
	if err := node.ipSteps(ctx, steps); err != nil {
		return nil, err
	}
	if err := pod.ipSteps(ctx, [][]string{
		{"addr", "add", pod.IP.String() + "/32", "dev", "eth0"},
		{"link", "set", "eth0", "up"},
		{"route", "add", gw.String(), "dev", "eth0", "scope", "link"},
		{"route", "add", "default", "via", gw.String(), "dev", "eth0"},
	}); err != nil {
		return nil, err
	}
	if node.PodCIDRv6.IsValid() {
		pod.IPv6 = nthAddr(node.PodCIDRv6, octet)
		gw6 := nthAddr(node.PodCIDRv6, 1)
		steps := [][]string{{"route", "add", pod.IPv6.String() + "/128", "dev", dev}}
		if !bridged {
			steps = append([][]string{{"addr", "add", gw6.String() + "/128", "dev", veth, "nodad"}}, steps...)
		}
		if err := node.ipSteps(ctx, steps); err != nil {
			return nil, err
		}
		if err := pod.ipSteps(ctx, [][]string{
			{"addr", "add", pod.IPv6.String() + "/128", "dev", "eth0", "nodad"},
			{"route", "add", gw6.String(), "dev", "eth0"},
			{"-6", "route", "add", "default", "via", gw6.String(), "dev", "eth0"},
		}); err != nil {
			return nil, err
		}
	}
	return pod, nil
}

// disableDAD turns IPv6 duplicate address detection off in ns for the links created from now
// on. Besides our addresses (added "nodad" anyway), it spares the kernel's link-local ones: while
// those are tentative, for a second or two after a link comes up, the first TCP connection over
// a new pod's link measurably waited two seconds.
func (ns *NS) disableDAD() error {
	for _, key := range []string{"net.ipv6.conf.all.accept_dad", "net.ipv6.conf.default.accept_dad"} {
		if err := ns.SetSysctl(key, "0"); err != nil {
			return err
		}
	}
	return nil
}

// ipSteps runs `ip -n <ns> <step>` for each step, stopping at the first error.
func (ns *NS) ipSteps(ctx context.Context, steps [][]string) error {
	for _, s := range steps {
		if err := ipCmd(ctx, append([]string{"-n", ns.name}, s...)...); err != nil {
			return err
		}
	}
	return nil
}

// nthAddr returns the address at offset n (0 <= n < 65536) from the start of a prefix.
func nthAddr(p netip.Prefix, n int) netip.Addr {
	a := p.Masked().Addr()
	if a.Is4() {
		b := a.As4()
		v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
		v += uint32(n)
		return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
	}
	b := a.As16()
	v := uint32(b[14])<<8 | uint32(b[15]) + uint32(n)
	b[14], b[15] = byte(v>>8), byte(v) // the prefixes of the plan leave these two bytes zero
	return netip.AddrFrom16(b)
}

// prefixOf formats addr with the length of p ("10.0.0.2/24").
func prefixOf(addr netip.Addr, p netip.Prefix) string {
	return netip.PrefixFrom(addr, p.Bits()).String()
}
