package manifests

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// testSvc returns a defaulted ClusterIP service without a cluster IP.
func testSvc(ns, name string, mod ...func(*v1.Service)) *v1.Service {
	s := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec:       v1.ServiceSpec{Ports: []v1.ServicePort{{Port: 80}}},
	}
	for _, m := range mod {
		m(s)
	}
	if errs := defaultAndValidateService(s); len(errs) > 0 {
		panic(fmt.Sprint(errs))
	}
	return s
}

func mustAllocator(t testing.TB, cidrs ...string) *allocator {
	t.Helper()
	var ps []netip.Prefix
	for _, c := range cidrs {
		ps = append(ps, netip.MustParsePrefix(c))
	}
	a, err := newAllocator(ps)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func emptyAlloc() allocation {
	return allocation{ips: map[string]map[v1.IPFamily]netip.Addr{}, ports: map[string]int32{}}
}

// randomNames returns n distinct service names (namespace, name), sorted as the source sorts.
func randomNames(r *rand.Rand, n int) [][2]string {
	seen := map[string]bool{}
	var out [][2]string
	for len(out) < n {
		ns := fmt.Sprintf("ns%d", r.IntN(20))
		name := fmt.Sprintf("svc-%x", r.Uint32())
		if seen[ns+"/"+name] {
			continue
		}
		seen[ns+"/"+name] = true
		out = append(out, [2]string{ns, name})
	}
	slices.SortFunc(out, func(a, b [2]string) int {
		return strings.Compare(objKey{kindService, a[0], a[1]}.String(), objKey{kindService, b[0], b[1]}.String())
	})
	return out
}

func ipsOf(out []*v1.Service) map[string]string {
	m := map[string]string{}
	for _, s := range out {
		if s != nil {
			m[s.Namespace+"/"+s.Name] = strings.Join(s.Spec.ClusterIPs, ",")
		}
	}
	return m
}

func TestClusterIPAllocationProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	a := mustAllocator(t, "10.96.0.0/16")
	rng := a.ranges[v1.IPv4Protocol]
	for round := 0; round < 20; round++ {
		names := randomNames(r, 50+r.IntN(3000))
		var svcs []*v1.Service
		for _, n := range names {
			svcs = append(svcs, testSvc(n[0], n[1]))
		}
		out, alloc, problems := a.allocate(svcs, emptyAlloc())
		if len(problems) != 0 {
			t.Fatalf("round %d: problems %v", round, problems)
		}
		used := map[string]string{}
		for i, s := range out {
			ip, err := netip.ParseAddr(s.Spec.ClusterIP)
			if err != nil {
				t.Fatalf("%s: cluster IP %q: %v", names[i], s.Spec.ClusterIP, err)
			}
			if !rng.allocatable(ip) || ip == netip.MustParseAddr("10.96.0.1") || ip == netip.MustParseAddr("10.96.0.0") || ip == netip.MustParseAddr("10.96.255.255") {
				t.Errorf("%s: cluster IP %s is not allocatable", names[i], ip)
			}
			if other, dup := used[s.Spec.ClusterIP]; dup {
				t.Errorf("cluster IP %s given to %s and %s", ip, other, names[i])
			}
			used[s.Spec.ClusterIP] = names[i][1]
			if !slices.Equal(s.Spec.ClusterIPs, []string{s.Spec.ClusterIP}) || !slices.Equal(s.Spec.IPFamilies, []v1.IPFamily{v1.IPv4Protocol}) ||
				*s.Spec.IPFamilyPolicy != v1.IPFamilyPolicySingleStack {
				t.Errorf("%s: clusterIPs %v families %v policy %v", names[i], s.Spec.ClusterIPs, s.Spec.IPFamilies, *s.Spec.IPFamilyPolicy)
			}
			if svcs[i].Spec.ClusterIP != "" {
				t.Fatalf("allocate modified its input")
			}
		}
		before := ipsOf(out)

		// A restart (no previous allocation) gives the same addresses.
		again, _, _ := a.allocate(svcs, emptyAlloc())
		if got := ipsOf(again); !mapsEqual(got, before) {
			t.Errorf("round %d: a restart moved addresses", round)
		}

		// While running, adding services never moves existing ones.
		more := randomNames(r, 200)
		var grown []*v1.Service
		grown = append(grown, svcs...)
		for _, n := range more {
			if _, clash := before[n[0]+"/"+n[1]]; !clash {
				grown = append(grown, testSvc(n[0], n[1]))
			}
		}
		slices.SortFunc(grown, func(x, y *v1.Service) int {
			return strings.Compare(objKey{kindService, x.Namespace, x.Name}.String(), objKey{kindService, y.Namespace, y.Name}.String())
		})
		out2, alloc2, _ := a.allocate(grown, alloc)
		got := ipsOf(out2)
		for k, ip := range before {
			if got[k] != ip {
				t.Errorf("round %d: adding services moved %s from %s to %s", round, k, ip, got[k])
			}
		}
		// And removing some never moves the others.
		var shrunk []*v1.Service
		for i, s := range grown {
			if i%3 != 0 {
				shrunk = append(shrunk, s)
			}
		}
		out3, _, _ := a.allocate(shrunk, alloc2)
		got3 := ipsOf(out3)
		for k, ip := range got3 {
			if got[k] != ip {
				t.Errorf("round %d: removing services moved %s from %s to %s", round, k, got[k], ip)
			}
		}
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestClusterIPRangeExhaustion(t *testing.T) {
	a := mustAllocator(t, "192.168.7.0/28") // 16 addresses: 13 allocatable
	var svcs []*v1.Service
	for i := 0; i < 14; i++ {
		svcs = append(svcs, testSvc("default", fmt.Sprintf("s%02d", i)))
	}
	out, _, problems := a.allocate(svcs, emptyAlloc())
	got := map[string]bool{}
	for _, s := range out {
		if s != nil {
			got[s.Spec.ClusterIP] = true
		}
	}
	if len(got) != 13 {
		t.Errorf("%d distinct addresses allocated, want 13: %v", len(got), got)
	}
	for _, reserved := range []string{"192.168.7.0", "192.168.7.1", "192.168.7.15"} {
		if got[reserved] {
			t.Errorf("reserved address %s allocated", reserved)
		}
	}
	if len(problems) != 1 || !problems[0].fatal || !strings.Contains(problems[0].msg, "exhausted") || out[13] != nil {
		t.Errorf("problems %+v, last service %v; want the 14th service refused as exhausted", problems, out[13])
	}
}

func TestExplicitClusterIPs(t *testing.T) {
	a := mustAllocator(t, "10.96.0.0/16")
	withIP := func(ip string) func(*v1.Service) { return func(s *v1.Service) { s.Spec.ClusterIP = ip } }
	// Find where "default/b" would hash to, then claim that address explicitly for "default/a".
	probeOut, _, _ := a.allocate([]*v1.Service{testSvc("default", "b")}, emptyAlloc())
	bHash := probeOut[0].Spec.ClusterIP

	svcs := []*v1.Service{
		testSvc("default", "a", withIP(bHash)),
		testSvc("default", "b"),
		testSvc("default", "c", withIP("172.16.0.1")),
		testSvc("default", "d", withIP("10.96.0.1")),
		testSvc("default", "e", withIP("10.96.0.1")),
	}
	out, _, problems := a.allocate(svcs, emptyAlloc())
	if out[0].Spec.ClusterIP != bHash {
		t.Errorf("explicit address not kept: %s", out[0].Spec.ClusterIP)
	}
	if out[1].Spec.ClusterIP == bHash || out[1].Spec.ClusterIP == "" {
		t.Errorf("b got %q, want another address than the explicit %s", out[1].Spec.ClusterIP, bHash)
	}
	if out[2] == nil || out[2].Spec.ClusterIP != "172.16.0.1" {
		t.Errorf("an address outside the range must still be served, got %v", out[2])
	}
	var msgs []string
	for _, p := range problems {
		if p.fatal {
			t.Errorf("unexpected fatal problem %+v", p)
		}
		msgs = append(msgs, p.key.Name+": "+p.msg)
	}
	want := []string{"c: cluster IP 172.16.0.1 is outside the service CIDRs", "e: cluster IP 10.96.0.1 is also used by Service default/d"}
	for _, w := range want {
		if !slices.ContainsFunc(msgs, func(m string) bool { return strings.HasPrefix(m, w) }) {
			t.Errorf("problems %q, want one starting %q", msgs, w)
		}
	}
	if len(msgs) != len(want) {
		t.Errorf("problems %q, want %d", msgs, len(want))
	}
}

func TestDualStackAllocation(t *testing.T) {
	policy := func(p v1.IPFamilyPolicy) func(*v1.Service) {
		return func(s *v1.Service) { s.Spec.IPFamilyPolicy = &p }
	}
	families := func(f ...v1.IPFamily) func(*v1.Service) { return func(s *v1.Service) { s.Spec.IPFamilies = f } }
	ip := func(ips ...string) func(*v1.Service) { return func(s *v1.Service) { s.Spec.ClusterIPs = ips } }
	tests := []struct {
		name      string
		cidrs     []string
		svc       *v1.Service
		wantFams  []v1.IPFamily
		wantIPs   []string // prefixes of the addresses; "" means allocated anywhere in range
		wantFatal string
	}{
		{name: "default single stack primary v4", cidrs: []string{"10.96.0.0/16", "fd00:96::/112"}, svc: testSvc("d", "a"),
			wantFams: []v1.IPFamily{v1.IPv4Protocol}, wantIPs: []string{"10.96."}},
		{name: "default single stack primary v6", cidrs: []string{"fd00:96::/112", "10.96.0.0/16"}, svc: testSvc("d", "a"),
			wantFams: []v1.IPFamily{v1.IPv6Protocol}, wantIPs: []string{"fd00:96::"}},
		{name: "PreferDualStack", cidrs: []string{"10.96.0.0/16", "fd00:96::/112"}, svc: testSvc("d", "a", policy(v1.IPFamilyPolicyPreferDualStack)),
			wantFams: []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}, wantIPs: []string{"10.96.", "fd00:96::"}},
		{name: "RequireDualStack with IPv6 first", cidrs: []string{"10.96.0.0/16", "fd00:96::/112"},
			svc:      testSvc("d", "a", policy(v1.IPFamilyPolicyRequireDualStack), families(v1.IPv6Protocol)),
			wantFams: []v1.IPFamily{v1.IPv6Protocol, v1.IPv4Protocol}, wantIPs: []string{"fd00:96::", "10.96."}},
		{name: "single IPv6 family requested", cidrs: []string{"10.96.0.0/16", "fd00:96::/112"}, svc: testSvc("d", "a", families(v1.IPv6Protocol)),
			wantFams: []v1.IPFamily{v1.IPv6Protocol}, wantIPs: []string{"fd00:96::"}},
		{name: "explicit v4, second family allocated", cidrs: []string{"10.96.0.0/16", "fd00:96::/112"},
			svc:      testSvc("d", "a", policy(v1.IPFamilyPolicyPreferDualStack), ip("10.96.3.3")),
			wantFams: []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}, wantIPs: []string{"10.96.3.3", "fd00:96::"}},
		{name: "explicit dual-stack pair", cidrs: []string{"10.96.0.0/16", "fd00:96::/112"},
			svc:      testSvc("d", "a", policy(v1.IPFamilyPolicyRequireDualStack), ip("fd00:96::5", "10.96.3.3")),
			wantFams: []v1.IPFamily{v1.IPv6Protocol, v1.IPv4Protocol}, wantIPs: []string{"fd00:96::5", "10.96.3.3"}},
		{name: "PreferDualStack on a single-stack cluster", cidrs: []string{"10.96.0.0/16"}, svc: testSvc("d", "a", policy(v1.IPFamilyPolicyPreferDualStack)),
			wantFams: []v1.IPFamily{v1.IPv4Protocol}, wantIPs: []string{"10.96."}},
		{name: "RequireDualStack on a single-stack cluster", cidrs: []string{"10.96.0.0/16"}, svc: testSvc("d", "a", policy(v1.IPFamilyPolicyRequireDualStack)),
			wantFatal: "single-stack"},
		{name: "IPv6 requested on an IPv4 cluster", cidrs: []string{"10.96.0.0/16"}, svc: testSvc("d", "a", families(v1.IPv6Protocol)),
			wantFatal: "no IPv6 service CIDR"},
		{name: "two families but SingleStack", cidrs: []string{"10.96.0.0/16", "fd00:96::/112"}, svc: testSvc("d", "a", families(v1.IPv4Protocol, v1.IPv6Protocol)),
			wantFatal: "SingleStack"},
		{name: "cluster IP not of the requested family", cidrs: []string{"10.96.0.0/16", "fd00:96::/112"}, svc: testSvc("d", "a", families(v1.IPv6Protocol), ip("10.96.3.3")),
			wantFatal: "not of family"},
		{name: "headless gets nothing", cidrs: []string{"10.96.0.0/16"}, svc: testSvc("d", "a", ip("None")), wantIPs: []string{"None"}},
		{name: "ExternalName gets nothing", cidrs: []string{"10.96.0.0/16"}, svc: testSvc("d", "a", func(s *v1.Service) {
			s.Spec.Type = v1.ServiceTypeExternalName
			s.Spec.ExternalName = "example.com"
		})},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := mustAllocator(t, tc.cidrs...)
			out, _, problems := a.allocate([]*v1.Service{tc.svc}, emptyAlloc())
			if tc.wantFatal != "" {
				if out[0] != nil || len(problems) != 1 || !problems[0].fatal || !strings.Contains(problems[0].msg, tc.wantFatal) {
					t.Fatalf("out %v problems %+v, want a fatal problem containing %q", out[0], problems, tc.wantFatal)
				}
				return
			}
			if len(problems) != 0 {
				t.Fatalf("problems %+v", problems)
			}
			s := out[0]
			if !slices.Equal(s.Spec.IPFamilies, tc.wantFams) {
				t.Errorf("families %v, want %v", s.Spec.IPFamilies, tc.wantFams)
			}
			if len(s.Spec.ClusterIPs) != len(tc.wantIPs) {
				t.Fatalf("cluster IPs %v, want %d", s.Spec.ClusterIPs, len(tc.wantIPs))
			}
			for i, w := range tc.wantIPs {
				if !strings.HasPrefix(s.Spec.ClusterIPs[i], w) {
					t.Errorf("clusterIPs[%d] = %s, want prefix %s", i, s.Spec.ClusterIPs[i], w)
				}
			}
			if len(tc.wantIPs) > 0 && s.Spec.ClusterIP != s.Spec.ClusterIPs[0] {
				t.Errorf("clusterIP %s != clusterIPs[0] %s", s.Spec.ClusterIP, s.Spec.ClusterIPs[0])
			}
		})
	}
}

func TestIPv6RangeAllocation(t *testing.T) {
	// A /64 is far larger than uint64 arithmetic on offsets could address from its start
	// without care; addresses must stay inside it and be distinct.
	a := mustAllocator(t, "fd00:1:2:3::/64")
	var svcs []*v1.Service
	for i := 0; i < 500; i++ {
		svcs = append(svcs, testSvc("default", fmt.Sprintf("s%03d", i)))
	}
	out, _, problems := a.allocate(svcs, emptyAlloc())
	if len(problems) != 0 {
		t.Fatal(problems)
	}
	seen := map[string]bool{}
	p := netip.MustParsePrefix("fd00:1:2:3::/64")
	for _, s := range out {
		ip := netip.MustParseAddr(s.Spec.ClusterIP)
		if !p.Contains(ip) || ip == netip.MustParseAddr("fd00:1:2:3::") || ip == netip.MustParseAddr("fd00:1:2:3::1") || seen[s.Spec.ClusterIP] {
			t.Errorf("bad or duplicate address %s", ip)
		}
		seen[s.Spec.ClusterIP] = true
	}
}

func TestAddOffset(t *testing.T) {
	tests := []struct {
		a    string
		off  uint64
		want string
	}{
		{"10.96.0.0", 2, "10.96.0.2"},
		{"10.96.0.0", 65535, "10.96.255.255"},
		{"fd00::", 1, "fd00::1"},
		{"fd00::ffff:ffff:ffff:ffff", 1, "fd00:0:0:1::"},
		{"fd00::", 1 << 40, "fd00::100:0:0"},
	}
	for _, tc := range tests {
		if got := addOffset(netip.MustParseAddr(tc.a), tc.off); got.String() != tc.want {
			t.Errorf("addOffset(%s, %d) = %s, want %s", tc.a, tc.off, got, tc.want)
		}
	}
}

func TestNodePortAllocation(t *testing.T) {
	a := mustAllocator(t, "10.96.0.0/16")
	nodePort := func(s *v1.Service) { s.Spec.Type = v1.ServiceTypeNodePort }
	lbLocal := func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeLoadBalancer
		s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	}
	svcs := []*v1.Service{
		testSvc("d", "a", nodePort, func(s *v1.Service) {
			s.Spec.Ports = []v1.ServicePort{{Name: "x", Port: 80, NodePort: 30080}, {Name: "y", Port: 81}}
		}),
		testSvc("d", "b", lbLocal),
		testSvc("d", "c", func(s *v1.Service) {
			s.Spec.Type = v1.ServiceTypeLoadBalancer
			f := false
			s.Spec.AllocateLoadBalancerNodePorts = &f
		}),
		testSvc("d", "e"),
		testSvc("d", "f", nodePort, func(s *v1.Service) { s.Spec.Ports[0].NodePort = 30080 }),
		testSvc("d", "g", nodePort, func(s *v1.Service) { s.Spec.Ports[0].NodePort = 8080 }),
	}
	out, alloc, problems := a.allocate(svcs, emptyAlloc())
	inRange := func(p int32) bool { return p >= NodePortMin && p <= NodePortMax }
	if p := out[0].Spec.Ports[0].NodePort; p != 30080 {
		t.Errorf("explicit node port changed to %d", p)
	}
	y := out[0].Spec.Ports[1].NodePort
	b, bh := out[1].Spec.Ports[0].NodePort, out[1].Spec.HealthCheckNodePort
	if !inRange(y) || !inRange(b) || !inRange(bh) || y == b || y == bh || b == bh || y == 30080 || b == 30080 || bh == 30080 {
		t.Errorf("allocated node ports y=%d b=%d health=%d: want distinct, in range, not 30080", y, b, bh)
	}
	if p := out[2].Spec.Ports[0].NodePort; p != 0 {
		t.Errorf("allocateLoadBalancerNodePorts=false got node port %d", p)
	}
	if p := out[3].Spec.Ports[0].NodePort; p != 0 {
		t.Errorf("ClusterIP service got node port %d", p)
	}
	var msgs []string
	for _, p := range problems {
		msgs = append(msgs, p.key.Name+": "+p.msg)
	}
	for _, w := range []string{"f: spec.ports[0].nodePort 30080 is also used by Service d/a", "g: spec.ports[0].nodePort 8080 is outside 30000-32767"} {
		if !slices.Contains(msgs, w) && !slices.ContainsFunc(msgs, func(m string) bool { return strings.HasPrefix(m, w) }) {
			t.Errorf("problems %q, want %q", msgs, w)
		}
	}
	// Stable: same input, fresh state → same ports; with state → same ports.
	for _, prev := range []allocation{emptyAlloc(), alloc} {
		again, _, _ := a.allocate(svcs, prev)
		if again[0].Spec.Ports[1].NodePort != y || again[1].Spec.Ports[0].NodePort != b || again[1].Spec.HealthCheckNodePort != bh {
			t.Errorf("node ports moved on reallocation")
		}
	}
}

func TestNodePortsUniqueProperty(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	a := mustAllocator(t, "10.96.0.0/16")
	names := randomNames(r, 1500)
	var svcs []*v1.Service
	for _, n := range names {
		svcs = append(svcs, testSvc(n[0], n[1], func(s *v1.Service) {
			s.Spec.Type = v1.ServiceTypeNodePort
			s.Spec.Ports = []v1.ServicePort{{Name: "a", Port: 80}, {Name: "b", Port: 443}}
		}))
	}
	out, _, problems := a.allocate(svcs, emptyAlloc())
	used := map[int32]bool{}
	exhausted := 0
	for _, p := range problems {
		if strings.Contains(p.msg, "exhausted") {
			exhausted++
		}
	}
	for _, s := range out {
		for _, p := range s.Spec.Ports {
			if p.NodePort == 0 {
				continue
			}
			if used[p.NodePort] || p.NodePort < NodePortMin || p.NodePort > NodePortMax {
				t.Fatalf("node port %d duplicate or out of range", p.NodePort)
			}
			used[p.NodePort] = true
		}
	}
	// 3000 ports wanted, 2768 available: all of the range used, the rest reported.
	if len(used) != NodePortMax-NodePortMin+1 || exhausted != 3000-len(used) {
		t.Errorf("%d ports allocated, %d reported exhausted", len(used), exhausted)
	}
}

// TestAllocationReusesCopies: a ClusterIP service allocated again with the same addresses is the
// same completed copy; one whose address moves, and a NodePort service, get new copies, and
// the copies handed out before are not modified.
func TestAllocationReusesCopies(t *testing.T) {
	a := mustAllocator(t, "10.96.0.0/16")
	b, np := testSvc("default", "b"), testSvc("default", "np", func(s *v1.Service) { s.Spec.Type = v1.ServiceTypeNodePort })
	first, alloc, _ := a.allocate([]*v1.Service{b, np}, emptyAlloc())
	again, alloc, _ := a.allocate([]*v1.Service{b, np}, alloc)
	if again[0] != first[0] {
		t.Error("service b: a new copy although nothing changed")
	}
	if again[1] == first[1] || !sameAllocation(again[1], first[1]) {
		t.Error("NodePort service np: the same copy, or a different allocation")
	}
	// A manifest now claims b's address: b moves, in a new copy.
	ip := first[0].Spec.ClusterIP
	claim := testSvc("default", "a", func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = ip, []string{ip} })
	moved, _, _ := a.allocate([]*v1.Service{claim, b, np}, alloc)
	if moved[1] == first[0] || moved[1].Spec.ClusterIP == ip {
		t.Errorf("service b: copy reused (%v) or address kept (%s) though a claims %s", moved[1] == first[0], moved[1].Spec.ClusterIP, ip)
	}
	if first[0].Spec.ClusterIP != ip {
		t.Errorf("the copy handed out before was modified: %s", first[0].Spec.ClusterIP)
	}
}

// TestExplicitClusterIPServedWithoutCopy: a ClusterIP service whose manifest gives its single
// cluster IP is complete once decoded (the family and policy the API server would default are
// filled in then), so the allocator hands out the decoded object itself, again and again; one
// that needs anything filled in (no address, a dual-stack policy, a node port) gets a copy and
// its decoded object stays as it was.
func TestExplicitClusterIPServedWithoutCopy(t *testing.T) {
	a := mustAllocator(t, "10.96.0.0/16", "fd00:96::/112")
	decoded := func(mod func(*v1.Service)) *v1.Service { return testSvc("default", "s", mod) } // as decoded: defaulted
	explicit := decoded(func(s *v1.Service) { s.Spec.ClusterIP = "10.96.0.10" })
	explicit6 := decoded(func(s *v1.Service) { s.Spec.ClusterIP = "fd00:96::a" })
	if got := explicit.Spec.IPFamilies; len(got) != 1 || got[0] != v1.IPv4Protocol || *explicit.Spec.IPFamilyPolicy != v1.IPFamilyPolicySingleStack {
		t.Fatalf("decoded: families %v, policy %v; want [IPv4] SingleStack", got, explicit.Spec.IPFamilyPolicy)
	}
	prefer := v1.IPFamilyPolicyPreferDualStack
	copied := map[string]*v1.Service{
		"no address": decoded(func(s *v1.Service) {}),
		"PreferDualStack": decoded(func(s *v1.Service) {
			s.Spec.ClusterIP, s.Spec.IPFamilyPolicy = "10.96.0.11", &prefer
		}),
		"NodePort": decoded(func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.Type = "10.96.0.12", v1.ServiceTypeNodePort }),
	}
	alloc := emptyAlloc()
	for round := range 2 {
		for _, svc := range []*v1.Service{explicit, explicit6} {
			var out []*v1.Service
			out, alloc, _ = a.allocate([]*v1.Service{svc}, alloc)
			if out[0] != svc {
				t.Errorf("round %d, %s: a copy of a complete service", round, svc.Spec.ClusterIP)
			}
		}
	}
	for name, svc := range copied {
		before := svc.DeepCopy()
		out, _, _ := a.allocate([]*v1.Service{svc}, emptyAlloc())
		if out[0] == svc {
			t.Errorf("%s: the decoded object was handed out though the allocator filled in fields", name)
		}
		if !equality.Semantic.DeepEqual(before, svc) {
			t.Errorf("%s: the decoded object was modified", name)
		}
	}
}
