package proxy

import (
	"errors"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

// svc returns a ClusterIP service ns/web with one TCP port 80 named "http", changed by edit.
func svc(edit func(*v1.Service)) *v1.Service {
	s := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web"},
		Spec: v1.ServiceSpec{
			Type:       v1.ServiceTypeClusterIP,
			ClusterIP:  "10.96.0.10",
			ClusterIPs: []string{"10.96.0.10"},
			Ports:      []v1.ServicePort{{Name: "http", Protocol: v1.ProtocolTCP, Port: 80}},
		},
	}
	if edit != nil {
		edit(s)
	}
	return s
}

// fieldErrors returns the fields named by the FieldErrors in err.
func fieldErrors(t *testing.T, err error) []string {
	t.Helper()
	if err == nil {
		return nil
	}
	var out []string
	var walk func(error)
	walk = func(e error) {
		if j, ok := e.(interface{ Unwrap() []error }); ok {
			for _, x := range j.Unwrap() {
				walk(x)
			}
			return
		}
		var fe *FieldError
		if !errors.As(e, &fe) {
			t.Fatalf("error %q is not a FieldError", e)
		}
		if fe.Object != "Service ns/web" {
			t.Errorf("error %q names object %q, want Service ns/web", e, fe.Object)
		}
		out = append(out, fe.Field)
	}
	walk(err)
	return out
}

func TestFromService(t *testing.T) {
	addrs := func(ss ...string) []netip.Addr {
		var out []netip.Addr
		for _, s := range ss {
			out = append(out, netip.MustParseAddr(s))
		}
		return out
	}
	cases := []struct {
		name       string
		edit       func(*v1.Service)
		wantPorts  int
		wantErrs   []string // fields named by the error, in order
		check      func(t *testing.T, sp *ServicePort)
		skipReason string
	}{
		{
			name:      "plain ClusterIP",
			wantPorts: 1,
			check: func(t *testing.T, sp *ServicePort) {
				if sp.Name.String() != "ns/web:http" || sp.Protocol != v1.ProtocolTCP || sp.Port != 80 || sp.NodePort != 0 {
					t.Errorf("got %+v", sp)
				}
				if sp.SessionAffinity || sp.AffinityTimeout != DefaultAffinityTimeout || sp.ProxyProtocol != ProxyProtocolNone {
					t.Errorf("affinity/proxy protocol: got %+v", sp)
				}
			},
		},
		{name: "headless", edit: func(s *v1.Service) { s.Spec.ClusterIP = v1.ClusterIPNone }, skipReason: "headless service"},
		{name: "ExternalName", edit: func(s *v1.Service) { s.Spec.Type = v1.ServiceTypeExternalName }, skipReason: "ExternalName service"},
		{name: "another proxy's", edit: func(s *v1.Service) { s.Labels = map[string]string{ServiceProxyNameLabel: "other"} },
			skipReason: "service labelled " + ServiceProxyNameLabel},
		{
			name:      "dual-stack, IPv4-mapped cluster IP unmapped",
			edit:      func(s *v1.Service) { s.Spec.ClusterIPs = []string{"::ffff:10.96.0.10", "fd00::10"} },
			wantPorts: 1,
			check: func(t *testing.T, sp *ServicePort) {
				if want := addrs("10.96.0.10", "fd00::10"); !equalAddrs(sp.ClusterIPs, want) {
					t.Errorf("ClusterIPs %v, want %v", sp.ClusterIPs, want)
				}
			},
		},
		{
			name:      "every cluster IP invalid: nothing served",
			edit:      func(s *v1.Service) { s.Spec.ClusterIPs = []string{"not-an-ip"} },
			wantPorts: 0,
			wantErrs:  []string{"spec.clusterIPs[0]"},
		},
		{
			name: "loadBalancerSourceRanges: trimmed, masked, bad entries reported and kept as matching nothing",
			edit: func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeLoadBalancer
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "dns", Protocol: v1.ProtocolUDP, Port: 53})
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "192.0.2.1"}}
				s.Spec.LoadBalancerSourceRanges = []string{" 203.0.113.0/24", "10.1.2.3/8", "not-a-cidr", "2001:db8::/32 ", "192.0.2.9"}
			},
			wantPorts: 2,
			wantErrs:  []string{"spec.loadBalancerSourceRanges[2]", "spec.loadBalancerSourceRanges[4]"},
			check: func(t *testing.T, sp *ServicePort) {
				want := []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24"), netip.MustParsePrefix("10.0.0.0/8"), {},
					netip.MustParsePrefix("2001:db8::/32"), {}}
				if !slices.Equal(sp.LoadBalancerSourceRanges, want) {
					t.Errorf("LoadBalancerSourceRanges %v, want %v", sp.LoadBalancerSourceRanges, want)
				}
				if want := addrs("192.0.2.1"); !equalAddrs(sp.LoadBalancerIPs, want) {
					t.Errorf("LoadBalancerIPs %v, want %v: the rest of the service is still served", sp.LoadBalancerIPs, want)
				}
			},
		},
		{
			name: "loadBalancerSourceRanges with leading zeros, as the API server accepts them",
			edit: func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeLoadBalancer
				s.Spec.LoadBalancerSourceRanges = []string{"010.001.0.0/16"}
			},
			wantPorts: 1,
			check: func(t *testing.T, sp *ServicePort) {
				if want := []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")}; !slices.Equal(sp.LoadBalancerSourceRanges, want) {
					t.Errorf("LoadBalancerSourceRanges %v, want %v", sp.LoadBalancerSourceRanges, want)
				}
			},
		},
		{
			name: "loadBalancerSourceRanges only apply to LoadBalancer services",
			edit: func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeNodePort
				s.Spec.LoadBalancerSourceRanges = []string{"203.0.113.0/24", "bad"}
			},
			wantPorts: 1,
			check: func(t *testing.T, sp *ServicePort) {
				if sp.LoadBalancerSourceRanges != nil {
					t.Errorf("LoadBalancerSourceRanges %v, want none", sp.LoadBalancerSourceRanges)
				}
			},
		},
		{
			name: "LoadBalancer: hostname-only ingress ignored, ipMode Proxy is NodePort only, bad IP reported",
			edit: func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeLoadBalancer
				s.Spec.Ports[0].NodePort = 30080
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{
					{IP: "192.0.2.1"},
					{Hostname: "lb.example"},
					{IP: "192.0.2.2", IPMode: ptr.To(v1.LoadBalancerIPModeProxy)},
					{IP: "192.0.2.300"},
					{IP: "192.0.2.3", IPMode: ptr.To(v1.LoadBalancerIPModeVIP)},
				}
			},
			wantPorts: 1,
			wantErrs:  []string{"status.loadBalancer.ingress[3].ip"},
			check: func(t *testing.T, sp *ServicePort) {
				if want := addrs("192.0.2.1", "192.0.2.3"); !equalAddrs(sp.LoadBalancerIPs, want) {
					t.Errorf("LoadBalancerIPs %v, want %v", sp.LoadBalancerIPs, want)
				}
				if sp.NodePort != 30080 {
					t.Errorf("NodePort %d, want 30080", sp.NodePort)
				}
			},
		},
		{
			name:      "NodePort of a ClusterIP service is ignored",
			edit:      func(s *v1.Service) { s.Spec.Ports[0].NodePort = 30080 },
			wantPorts: 1,
			check: func(t *testing.T, sp *ServicePort) {
				if sp.NodePort != 0 {
					t.Errorf("NodePort %d, want 0", sp.NodePort)
				}
			},
		},
		{
			name: "ClientIP affinity with its own timeout",
			edit: func(s *v1.Service) {
				s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
				s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To(int32(60))}}
			},
			wantPorts: 1,
			check: func(t *testing.T, sp *ServicePort) {
				if !sp.SessionAffinity || sp.AffinityTimeout != time.Minute {
					t.Errorf("affinity %v timeout %v, want true 1m", sp.SessionAffinity, sp.AffinityTimeout)
				}
			},
		},
		{
			name: "affinity timeout out of range: default used, field reported",
			edit: func(s *v1.Service) {
				s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
				s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To(int32(0))}}
			},
			wantPorts: 1,
			wantErrs:  []string{"spec.sessionAffinityConfig.clientIP.timeoutSeconds"},
			check: func(t *testing.T, sp *ServicePort) {
				if !sp.SessionAffinity || sp.AffinityTimeout != DefaultAffinityTimeout {
					t.Errorf("affinity %v timeout %v, want true %v", sp.SessionAffinity, sp.AffinityTimeout, DefaultAffinityTimeout)
				}
			},
		},
		{
			name: "bad ports left out, good ones kept",
			edit: func(s *v1.Service) {
				s.Spec.Ports = append(s.Spec.Ports,
					v1.ServicePort{Name: "sctp", Protocol: v1.ProtocolSCTP, Port: 81},
					v1.ServicePort{Name: "big", Protocol: v1.ProtocolTCP, Port: 70000},
					v1.ServicePort{Name: "http", Protocol: v1.ProtocolUDP, Port: 82},
					v1.ServicePort{Name: "dns", Port: 53}, // protocol defaults to TCP
				)
			},
			wantPorts: 2,
			wantErrs:  []string{"spec.ports[1].protocol", "spec.ports[2].port", "spec.ports[3].name"},
		},
		{
			name:      "PROXY protocol v2",
			edit:      func(s *v1.Service) { s.Annotations = map[string]string{ProxyProtocolAnnotation: "v2"} },
			wantPorts: 1,
			check: func(t *testing.T, sp *ServicePort) {
				if sp.ProxyProtocol != ProxyProtocolV2 {
					t.Errorf("ProxyProtocol %q, want v2", sp.ProxyProtocol)
				}
			},
		},
		{
			name:      "PROXY protocol malformed: reported, service still served without a header",
			edit:      func(s *v1.Service) { s.Annotations = map[string]string{ProxyProtocolAnnotation: "v3"} },
			wantPorts: 1,
			wantErrs:  []string{"metadata.annotations[" + ProxyProtocolAnnotation + "]"},
			check: func(t *testing.T, sp *ServicePort) {
				if sp.ProxyProtocol != ProxyProtocolNone {
					t.Errorf("ProxyProtocol %q, want none", sp.ProxyProtocol)
				}
			},
		},
		{
			name: "externalTrafficPolicy Local on NodePort, health check port only for LoadBalancer",
			edit: func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeNodePort
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				s.Spec.HealthCheckNodePort = 32000
			},
			wantPorts: 1,
			check: func(t *testing.T, sp *ServicePort) {
				if !sp.ExternalPolicyLocal || sp.HealthCheckNodePort != 0 {
					t.Errorf("ExternalPolicyLocal %v HealthCheckNodePort %d, want true 0", sp.ExternalPolicyLocal, sp.HealthCheckNodePort)
				}
			},
		},
		{
			name:      "externalTrafficPolicy Local means nothing for a plain ClusterIP service",
			edit:      func(s *v1.Service) { s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal },
			wantPorts: 1,
			check: func(t *testing.T, sp *ServicePort) {
				if sp.ExternalPolicyLocal {
					t.Error("ExternalPolicyLocal set on a ClusterIP service without external IPs")
				}
			},
		},
		{
			name: "externalIPs: bad one reported, Local policy applies",
			edit: func(s *v1.Service) {
				s.Spec.ExternalIPs = []string{"203.0.113.5", "bogus"}
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				s.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyLocal)
			},
			wantPorts: 1,
			wantErrs:  []string{"spec.externalIPs[1]"},
			check: func(t *testing.T, sp *ServicePort) {
				if !equalAddrs(sp.ExternalIPs, addrs("203.0.113.5")) || !sp.ExternalPolicyLocal || !sp.InternalPolicyLocal {
					t.Errorf("got %+v", sp)
				}
				if !sp.UsesExternalPolicy(netip.MustParseAddr("203.0.113.5")) || sp.UsesExternalPolicy(netip.MustParseAddr("::ffff:10.96.0.10")) {
					t.Error("UsesExternalPolicy: external IP must use it, the (mapped) cluster IP must not")
				}
			},
		},
		{
			name:      "no topology asked",
			wantPorts: 1,
			check:     wantTopology(TopologyNone),
		},
		{
			name:      "topology-mode Auto",
			edit:      func(s *v1.Service) { s.Annotations = map[string]string{v1.AnnotationTopologyMode: "Auto"} },
			wantPorts: 1,
			check:     wantTopology(TopologyAuto),
		},
		{
			name: "deprecated topology-aware-hints auto",
			edit: func(s *v1.Service) {
				s.Annotations = map[string]string{v1.DeprecatedAnnotationTopologyAwareHints: "auto"}
			},
			wantPorts: 1,
			check:     wantTopology(TopologyAuto),
		},
		{
			name: "topology-aware-hints, when present, shadows topology-mode (EndpointSlice controller's precedence)",
			edit: func(s *v1.Service) {
				s.Annotations = map[string]string{v1.DeprecatedAnnotationTopologyAwareHints: "Disabled", v1.AnnotationTopologyMode: "Auto"}
			},
			wantPorts: 1,
			check:     wantTopology(TopologyNone),
		},
		{
			name:      "topology-mode other than Auto or auto asks for nothing",
			edit:      func(s *v1.Service) { s.Annotations = map[string]string{v1.AnnotationTopologyMode: "AUTO"} },
			wantPorts: 1,
			check:     wantTopology(TopologyNone),
		},
		{
			name:      "trafficDistribution PreferClose is PreferSameZone",
			edit:      func(s *v1.Service) { s.Spec.TrafficDistribution = ptr.To(v1.ServiceTrafficDistributionPreferClose) },
			wantPorts: 1,
			check:     wantTopology(TopologyPreferSameZone),
		},
		{
			name:      "trafficDistribution PreferSameZone",
			edit:      func(s *v1.Service) { s.Spec.TrafficDistribution = ptr.To(v1.ServiceTrafficDistributionPreferSameZone) },
			wantPorts: 1,
			check:     wantTopology(TopologyPreferSameZone),
		},
		{
			name:      "trafficDistribution PreferSameNode",
			edit:      func(s *v1.Service) { s.Spec.TrafficDistribution = ptr.To(v1.ServiceTrafficDistributionPreferSameNode) },
			wantPorts: 1,
			check:     wantTopology(TopologyPreferSameNode),
		},
		{
			name: "the Auto annotation wins over trafficDistribution",
			edit: func(s *v1.Service) {
				s.Annotations = map[string]string{v1.AnnotationTopologyMode: "Auto"}
				s.Spec.TrafficDistribution = ptr.To(v1.ServiceTrafficDistributionPreferSameNode)
			},
			wantPorts: 1,
			check:     wantTopology(TopologyAuto),
		},
		{
			name: "a disabled annotation leaves trafficDistribution in charge",
			edit: func(s *v1.Service) {
				s.Annotations = map[string]string{v1.AnnotationTopologyMode: "Disabled"}
				s.Spec.TrafficDistribution = ptr.To(v1.ServiceTrafficDistributionPreferClose)
			},
			wantPorts: 1,
			check:     wantTopology(TopologyPreferSameZone),
		},
		{
			name:      "unknown trafficDistribution: reported, no topology asked",
			edit:      func(s *v1.Service) { s.Spec.TrafficDistribution = ptr.To("PreferSameRack") },
			wantPorts: 1,
			wantErrs:  []string{"spec.trafficDistribution"},
			check:     wantTopology(TopologyNone),
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := svc(tc.edit)
			if got := SkipReason(s); got != tc.skipReason {
				t.Fatalf("SkipReason = %q, want %q", got, tc.skipReason)
			}
			ports, err := FromService(s)
			if got := fieldErrors(t, err); strings.Join(got, ",") != strings.Join(tc.wantErrs, ",") {
				t.Errorf("errors name %q, want %q (err: %v)", got, tc.wantErrs, err)
			}
			if len(ports) != tc.wantPorts {
				t.Fatalf("got %d ports, want %d", len(ports), tc.wantPorts)
			}
			if tc.check != nil && len(ports) > 0 {
				tc.check(t, ports[0])
			}
			for _, sp := range ports {
				if !sp.Equal(sp) {
					t.Errorf("%v not Equal to itself", sp)
				}
			}
		})
	}
}

func wantTopology(want Topology) func(t *testing.T, sp *ServicePort) {
	return func(t *testing.T, sp *ServicePort) {
		if sp.Topology != want {
			t.Errorf("Topology %q, want %q", sp.Topology, want)
		}
	}
}

func equalAddrs(a, b []netip.Addr) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestServicePortEqual(t *testing.T) {
	base, _ := FromService(svc(nil))
	for _, tc := range []struct {
		name string
		edit func(*v1.Service)
	}{
		{"port", func(s *v1.Service) { s.Spec.Ports[0].Port = 81 }},
		{"protocol", func(s *v1.Service) { s.Spec.Ports[0].Protocol = v1.ProtocolUDP }},
		{"cluster IP", func(s *v1.Service) { s.Spec.ClusterIPs = []string{"10.96.0.11"} }},
		{"external IP", func(s *v1.Service) { s.Spec.ExternalIPs = []string{"203.0.113.5"} }},
		{"affinity", func(s *v1.Service) { s.Spec.SessionAffinity = v1.ServiceAffinityClientIP }},
		{"internal policy", func(s *v1.Service) { s.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyLocal) }},
		{"proxy protocol", func(s *v1.Service) { s.Annotations = map[string]string{ProxyProtocolAnnotation: "v1"} }},
		{"topology", func(s *v1.Service) { s.Spec.TrafficDistribution = ptr.To(v1.ServiceTrafficDistributionPreferClose) }},
		{"source ranges", func(s *v1.Service) {
			s.Spec.Type = v1.ServiceTypeLoadBalancer
			s.Spec.LoadBalancerSourceRanges = []string{"203.0.113.0/24"}
		}},
	} {
		changed, err := FromService(svc(tc.edit))
		if err != nil || len(changed) != 1 {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if base[0].Equal(changed[0]) {
			t.Errorf("%s: a changed %s compares Equal", tc.name, tc.name)
		}
	}
	same, _ := FromService(svc(nil))
	if !base[0].Equal(same[0]) {
		t.Error("two conversions of the same service differ")
	}
}

func TestEndpointsFromSlices(t *testing.T) {
	name := types.NamespacedName{Namespace: "ns", Name: "web"}
	slice := func(n string, at discovery.AddressType, ports []discovery.EndpointPort, eps ...discovery.Endpoint) *discovery.EndpointSlice {
		return &discovery.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: n, Labels: map[string]string{discovery.LabelServiceName: "web"}},
			AddressType: at,
			Ports:       ports,
			Endpoints:   eps,
		}
	}
	http := []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To(int32(8080))}}
	ep := func(addr string, ready, serving, terminating *bool, node string) discovery.Endpoint {
		e := discovery.Endpoint{Addresses: []string{addr},
			Conditions: discovery.EndpointConditions{Ready: ready, Serving: serving, Terminating: terminating}}
		if node != "" {
			e.NodeName = ptr.To(node)
		}
		return e
	}
	t1, f := ptr.To(true), ptr.To(false)

	got, err := endpointsFromSlices(name, []*discovery.EndpointSlice{
		slice("web-b", discovery.AddressTypeIPv4, http,
			ep("10.0.0.2", f, t1, t1, "node2"),     // terminating but serving
			ep("10.0.0.1", nil, nil, nil, "node1"), // unset conditions: ready, serving, not terminating
			ep("10.0.0.300", t1, nil, nil, ""),     // invalid
		),
		slice("web-a", discovery.AddressTypeIPv4, http,
			ep("10.0.0.2", t1, nil, nil, "node2"), // the ready copy of a duplicate wins
			ep("10.0.0.3", f, f, nil, ""),         // not ready, not serving
		),
		slice("web-6", discovery.AddressTypeIPv6, http, ep("fd00::1", nil, nil, nil, "")),
		slice("web-fqdn", discovery.AddressTypeFQDN, http, ep("example.com", nil, nil, nil, "")),
		slice("web-bad", discovery.AddressTypeIPv4, []discovery.EndpointPort{{Name: ptr.To("x")}, {Name: ptr.To("y"), Port: ptr.To(int32(0))}},
			ep("10.0.0.9", nil, nil, nil, "")),
	})
	var fields []string
	for _, e := range err.(interface{ Unwrap() []error }).Unwrap() {
		var fe *FieldError
		if !errors.As(e, &fe) {
			t.Fatalf("error %v is not a FieldError", e)
		}
		fields = append(fields, fe.Object+" "+fe.Field)
	}
	wantFields := "EndpointSlice ns/web-b endpoints[2].addresses[0],EndpointSlice ns/web-bad ports[0].port,EndpointSlice ns/web-bad ports[1].port"
	if strings.Join(fields, ",") != wantFields {
		t.Errorf("errors name %q, want %q", fields, wantFields)
	}
	want := []Endpoint{
		{Addr: netip.MustParseAddrPort("10.0.0.1:8080"), Ready: true, Serving: true, NodeName: "node1"},
		{Addr: netip.MustParseAddrPort("10.0.0.2:8080"), Ready: true, Serving: true, NodeName: "node2"},
		{Addr: netip.MustParseAddrPort("10.0.0.3:8080")},
		{Addr: netip.MustParseAddrPort("[fd00::1]:8080"), Ready: true, Serving: true},
	}
	if len(got) != 1 || len(got["http"]) != len(want) {
		t.Fatalf("got %v, want only port http with %v", got, want)
	}
	for i := range want {
		if got["http"][i] != want[i] {
			t.Errorf("endpoint %d: got %+v, want %+v", i, got["http"][i], want[i])
		}
	}

	// Without the ready copy, the terminating one stays, with its conditions.
	got, err = endpointsFromSlices(name, []*discovery.EndpointSlice{
		slice("web-b", discovery.AddressTypeIPv4, http, ep("10.0.0.2", f, t1, t1, "node2")),
	})
	if err != nil {
		t.Fatal(err)
	}
	if e := got["http"][0]; e.Ready || !e.Serving || !e.Terminating {
		t.Errorf("terminating endpoint: got %+v", e)
	}
}

func TestEndpointHints(t *testing.T) {
	name := types.NamespacedName{Namespace: "ns", Name: "web"}
	http := []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To(int32(8080))}, {Name: ptr.To("alt"), Port: ptr.To(int32(8081))}}
	zones := func(z ...string) []discovery.ForZone {
		var out []discovery.ForZone
		for _, n := range z {
			out = append(out, discovery.ForZone{Name: n})
		}
		return out
	}
	nodes := func(n ...string) []discovery.ForNode {
		var out []discovery.ForNode
		for _, x := range n {
			out = append(out, discovery.ForNode{Name: x})
		}
		return out
	}
	cases := []struct {
		name               string
		hints              *discovery.EndpointHints
		wantZones          Hints
		wantNodes          Hints
		wantErrs           []string // fields named by the error, in order (each once, not per port)
		wantZoneNames      []string
		hasZone, lacksZone string
	}{
		{name: "no hints"},
		{name: "empty hints", hints: &discovery.EndpointHints{}},
		{
			name:      "zones sorted, duplicates once",
			hints:     &discovery.EndpointHints{ForZones: zones("zone-b", "zone-a", "zone-b")},
			wantZones: "zone-a,zone-b", wantZoneNames: []string{"zone-a", "zone-b"},
			hasZone: "zone-b", lacksZone: "zone",
		},
		{
			name:      "zones and nodes",
			hints:     &discovery.EndpointHints{ForZones: zones("zone-a"), ForNodes: nodes("node1")},
			wantZones: "zone-a", wantNodes: "node1", wantZoneNames: []string{"zone-a"},
		},
		{
			name:      "invalid names reported and left out",
			hints:     &discovery.EndpointHints{ForZones: zones("zone-a", "", "a,b"), ForNodes: nodes("Node_1", "node2")},
			wantZones: "zone-a", wantNodes: "node2", wantZoneNames: []string{"zone-a"},
			wantErrs: []string{"endpoints[0].hints.forZones[1].name", "endpoints[0].hints.forZones[2].name", "endpoints[0].hints.forNodes[0].name"},
		},
		{
			name:     "only invalid names: not hinted",
			hints:    &discovery.EndpointHints{ForZones: zones("bad zone")},
			wantErrs: []string{"endpoints[0].hints.forZones[0].name"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := &discovery.EndpointSlice{
				ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: "web-a", Labels: map[string]string{discovery.LabelServiceName: "web"}},
				AddressType: discovery.AddressTypeIPv4,
				Ports:       http,
				Endpoints:   []discovery.Endpoint{{Addresses: []string{"10.0.0.1"}, Hints: tc.hints}},
			}
			got, err := endpointsFromSlices(name, []*discovery.EndpointSlice{s})
			var fields []string
			if err != nil {
				for _, e := range err.(interface{ Unwrap() []error }).Unwrap() {
					var fe *FieldError
					if !errors.As(e, &fe) {
						t.Fatalf("error %v is not a FieldError", e)
					}
					fields = append(fields, fe.Field)
				}
			}
			if strings.Join(fields, ",") != strings.Join(tc.wantErrs, ",") {
				t.Errorf("errors name %q, want %q", fields, tc.wantErrs)
			}
			for _, port := range []string{"http", "alt"} {
				if len(got[port]) != 1 {
					t.Fatalf("port %s: got %v, want one endpoint", port, got[port])
				}
				e := got[port][0]
				if e.ZoneHints != tc.wantZones || e.NodeHints != tc.wantNodes {
					t.Errorf("port %s: hints zones %q nodes %q, want %q %q", port, e.ZoneHints, e.NodeHints, tc.wantZones, tc.wantNodes)
				}
			}
			e := got["http"][0]
			if names := e.ZoneHints.Names(); strings.Join(names, ",") != strings.Join(tc.wantZoneNames, ",") {
				t.Errorf("ZoneHints.Names() = %q, want %q", names, tc.wantZoneNames)
			}
			if e.ZoneHints.Empty() != (tc.wantZones == "") {
				t.Errorf("ZoneHints.Empty() = %v for %q", e.ZoneHints.Empty(), e.ZoneHints)
			}
			if tc.hasZone != "" && !e.ZoneHints.Has(tc.hasZone) {
				t.Errorf("ZoneHints %q has no %q", e.ZoneHints, tc.hasZone)
			}
			if e.ZoneHints.Has(tc.lacksZone) {
				t.Errorf("ZoneHints %q has %q", e.ZoneHints, tc.lacksZone)
			}
			// Endpoints stay comparable: the same slice converted twice gives equal endpoints,
			// and a change of hints alone makes them differ.
			again, _ := endpointsFromSlices(name, []*discovery.EndpointSlice{s})
			if again["http"][0] != e {
				t.Errorf("two conversions differ: %+v and %+v", again["http"][0], e)
			}
			other := e
			other.ZoneHints = NewHints("zone-z")
			if other == e {
				t.Error("endpoints with different hints compare equal")
			}
		})
	}
}

func TestSliceServiceName(t *testing.T) {
	s := &discovery.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web-abc",
		Labels: map[string]string{discovery.LabelServiceName: "web"}}}
	if n, ok := SliceServiceName(s); !ok || n != (types.NamespacedName{Namespace: "ns", Name: "web"}) {
		t.Errorf("got %v %v", n, ok)
	}
	s.Labels = nil
	if _, ok := SliceServiceName(s); ok {
		t.Error("a slice without the service-name label belongs to a service")
	}
}

// TestNameCompare: Compare orders names as their strings do, separators and prefixes included
// (random names over a small alphabet, with parts that hold the separators too).
func TestNameCompare(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	part := func() string {
		const alphabet = "ab-.:/"
		b := make([]byte, r.IntN(4))
		for i := range b {
			b[i] = alphabet[r.IntN(len(alphabet))]
		}
		return string(b)
	}
	name := func() Name { return Name{Namespace: part(), Name: part(), Port: part()} }
	for range 200_000 {
		a, b := name(), name()
		if r.IntN(3) == 0 {
			b.Namespace = a.Namespace
			if r.IntN(2) == 0 {
				b.Name = a.Name
			}
		}
		if got, want := a.Compare(b), strings.Compare(a.String(), b.String()); got != want {
			t.Fatalf("%q.Compare(%q) = %d, want %d", a, b, got, want)
		}
	}
	if n := testing.AllocsPerRun(100, func() {
		Name{Namespace: "ns", Name: "web", Port: "http"}.Compare(Name{Namespace: "ns", Name: "web-2", Port: "http"})
	}); n != 0 {
		t.Errorf("Compare allocates %v times, want 0", n)
	}
}
