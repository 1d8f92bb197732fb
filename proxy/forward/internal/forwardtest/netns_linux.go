package forwardtest

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
)

// netnsEnv carries the name of the network namespace InNATNetns made to the copy of the test
// binary it runs inside it.
const netnsEnv = "KUP_FORWARD_NETNS"

// InNATNetns runs inside in a network namespace made for the test, where it may change iptables:
// it makes the namespace (lo up; a veth with 192.0.2.1/24 and fd00:2::1/64, and routes to the
// "service" ranges 10.96.0.0/16 and fd00:96::/64 through it), runs the test binary again inside
// it for this test alone, and there, having checked that it is inside the namespace, calls
// inside. It needs root; the namespace is removed when the test ends.
func InNATNetns(t *testing.T, inside func(t *testing.T)) {
	if ns := os.Getenv(netnsEnv); ns != "" {
		// Refuse to touch iptables unless really inside the namespace made for the test.
		if got := strings.TrimSpace(Run(t, "ip", "netns", "identify", fmt.Sprint(os.Getpid()))); got != ns {
			t.Fatalf("not inside network namespace %s (identify says %q)", ns, got)
		}
		inside(t)
		return
	}
	testenv.Privileged(t)
	ns := fmt.Sprintf("kup-fwd-%d", os.Getpid())
	Run(t, "ip", "netns", "add", ns)
	t.Cleanup(func() { Run(t, "ip", "netns", "del", ns) })
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"link", "add", "kup0", "type", "veth", "peer", "name", "kup1"},
		{"link", "set", "kup0", "up"},
		{"link", "set", "kup1", "up"},
		{"addr", "add", "192.0.2.1/24", "dev", "kup0"},
		{"addr", "add", "fd00:2::1/64", "dev", "kup0", "nodad"},
		{"route", "add", "10.96.0.0/16", "dev", "kup0"},
		{"route", "add", "fd00:96::/64", "dev", "kup0"},
	} {
		Run(t, "ip", append([]string{"-n", ns}, args...)...)
	}
	cmd := exec.Command("ip", "netns", "exec", ns, os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), netnsEnv+"="+ns)
	out, err := cmd.CombinedOutput()
	t.Logf("inside %s:\n%s", ns, out)
	if err != nil {
		t.Fatalf("test inside the namespace: %v", err)
	}
}

// Run runs a command and returns its output, failing the test when it fails.
func Run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// NATCase is one way a client inside InNATNetns reaches a proxy: through a DNAT or REDIRECT rule
// for a service address, or directly.
type NATCase struct {
	Name    string
	Listen  string // the proxy's listen address (port chosen)
	Iptbl   string // iptables or ip6tables; "" for no rule
	Target  string // the rule's target, %d = the proxy's port
	Service string // where the client sends
	// Direct: the client sends to the proxy's own address; the Chooser must see no dst.
	Direct bool
}

// NATCases are the cases for protocol proto ("tcp" or "udp"; the names start with it in capitals)
// to a service port servicePort.
func NATCases(proto string, servicePort uint16) []NATCase {
	P := strings.ToUpper(proto)
	svc := func(a string) string { return netip.AddrPortFrom(netip.MustParseAddr(a), servicePort).String() }
	return []NATCase{
		{P + " IPv4 DNAT", "192.0.2.1:0", "iptables", "DNAT --to-destination 192.0.2.1:%d", svc("10.96.0.10"), false},
		{P + " IPv4 REDIRECT to a wildcard listener", "0.0.0.0:0", "iptables", "REDIRECT --to-ports %d", svc("10.96.0.11"), false},
		{P + " IPv4 client of a dual-stack listener", "[::]:0", "iptables", "DNAT --to-destination 192.0.2.1:%d", svc("10.96.0.12"), false},
		{P + " IPv6 DNAT", "[::]:0", "ip6tables", "DNAT --to-destination [fd00:2::1]:%d", svc("fd00:96::10"), false},
		{P + " direct", "192.0.2.1:0", "", "", "", true},
		{P + " direct to a dual-stack listener", "[::]:0", "", "", "", true},
	}
}

// Dest returns where the client of the case sends (target) and the original destination the
// Chooser must see (service; the zero AddrPort when Direct), having added the NAT rule for proto
// to the proxy's port, removed when the test ends.
func (tc NATCase) Dest(t *testing.T, proto string, port uint16) (target, service netip.AddrPort) {
	listen := netip.MustParseAddrPort(tc.Listen)
	if tc.Direct {
		a := listen.Addr()
		if a.IsUnspecified() {
			a = netip.MustParseAddr("192.0.2.1")
		}
		return netip.AddrPortFrom(a, port), netip.AddrPort{}
	}
	service = netip.MustParseAddrPort(tc.Service)
	rule := append([]string{"OUTPUT", "-p", proto, "-d", service.Addr().String(),
		"--dport", fmt.Sprint(service.Port()), "-j"}, strings.Fields(fmt.Sprintf(tc.Target, port))...)
	Run(t, tc.Iptbl, append([]string{"-t", "nat", "-A"}, rule...)...)
	t.Cleanup(func() { Run(t, tc.Iptbl, append([]string{"-t", "nat", "-D"}, rule...)...) })
	return service, service
}

// RunNATCases runs each of NATCases(proto, servicePort) as a subtest inside InNATNetns: serve
// starts a proxy listening on the case's address with chooser (whose endpoint it sets) and
// returns its port; exchange sends through the case's target and checks the answer. The
// chooser must then have been asked once, with the case's service address as the original
// destination (none when the client sent to the proxy directly).
func RunNATCases(t *testing.T, proto string, servicePort uint16,
	serve func(t *testing.T, listen netip.AddrPort, chooser *Chooser) uint16,
	exchange func(t *testing.T, target netip.AddrPort)) {
	InNATNetns(t, func(t *testing.T) {
		for _, tc := range NATCases(proto, servicePort) {
			t.Run(tc.Name, func(t *testing.T) {
				chooser := &Chooser{}
				port := serve(t, netip.MustParseAddrPort(tc.Listen), chooser)
				target, service := tc.Dest(t, proto, port)
				exchange(t, target)
				calls := chooser.Recorded()
				if len(calls) != 1 || calls[0].Dst != service {
					t.Fatalf("Choose calls %+v, want one with dst %v", calls, service)
				}
				t.Logf("client %v, dst %v", calls[0].Client, calls[0].Dst)
			})
		}
	})
}
