package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"
)

// The fuzz targets build Services and EndpointSlices from YAML (or JSON), decoded leniently
// into the k8s.io/api types: any object a source could hand over, valid or not for the API
// server. The model must not panic, must return only values the rest of the proxy can use as
// they are, and must report every problem as a FieldError naming the object.

// fieldErrorsOf checks that err is nil or a join of FieldErrors naming one of objects, and
// returns them.
func fieldErrorsOf(t *testing.T, err error, objects ...string) []*FieldError {
	t.Helper()
	if err == nil {
		return nil
	}
	var out []*FieldError
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
			t.Fatalf("error %q (%T) is not a FieldError", e, e)
		}
		if !slices.Contains(objects, fe.Object) || fe.Field == "" || fe.Detail == "" {
			t.Fatalf("FieldError %#v does not name one of %q, a field and a detail", fe, objects)
		}
		out = append(out, fe)
	}
	walk(err)
	return out
}

// checkAddr fails unless a is an address the portals and dialers can use as it is.
func checkAddr(t *testing.T, what string, a netip.Addr) {
	t.Helper()
	if !a.IsValid() || a.Zone() != "" || a.Is4In6() {
		t.Fatalf("%s %v: not a plain IPv4 or IPv6 address", what, a)
	}
}

// checkServicePorts checks what FromService returned for svc.
func checkServicePorts(t *testing.T, svc *v1.Service, sps []*ServicePort) {
	t.Helper()
	if len(sps) > 0 && SkipReason(svc) != "" {
		t.Fatalf("ports returned for a service skipped as %q", SkipReason(svc))
	}
	names := map[string]bool{}
	for _, sp := range sps {
		if sp == nil {
			t.Fatal("nil ServicePort")
		}
		if sp.Name.Namespace != svc.Namespace || sp.Name.Name != svc.Name || sp.Name.Namespace == "" || sp.Name.Name == "" {
			t.Fatalf("%s: name does not match service %s/%s", sp, svc.Namespace, svc.Name)
		}
		if names[sp.Name.Port] {
			t.Fatalf("%s: two ServicePorts of the same name", sp)
		}
		names[sp.Name.Port] = true
		if !slices.ContainsFunc(svc.Spec.Ports, func(p v1.ServicePort) bool { return p.Name == sp.Name.Port }) {
			t.Fatalf("%s: no spec.ports entry of that name", sp)
		}
		if sp.Protocol != v1.ProtocolTCP && sp.Protocol != v1.ProtocolUDP {
			t.Fatalf("%s: protocol %q", sp, sp.Protocol)
		}
		if sp.Port < 1 || sp.Port > 65535 || sp.NodePort < 0 || sp.NodePort > 65535 || sp.HealthCheckNodePort < 0 || sp.HealthCheckNodePort > 65535 {
			t.Fatalf("%s: port %d nodePort %d healthCheckNodePort %d out of range", sp, sp.Port, sp.NodePort, sp.HealthCheckNodePort)
		}
		if len(sp.ClusterIPs) < 1 || len(sp.ClusterIPs) > 2 {
			t.Fatalf("%s: %d cluster IPs", sp, len(sp.ClusterIPs))
		}
		for _, a := range sp.ClusterIPs {
			checkAddr(t, sp.String()+" cluster IP", a)
		}
		if len(sp.ClusterIPs) == 2 && sp.ClusterIPs[0].Is4() == sp.ClusterIPs[1].Is4() {
			t.Fatalf("%s: cluster IPs %v of one family", sp, sp.ClusterIPs)
		}
		for _, a := range sp.ExternalIPs {
			checkAddr(t, sp.String()+" external IP", a)
		}
		for _, a := range sp.LoadBalancerIPs {
			checkAddr(t, sp.String()+" load balancer IP", a)
		}
		if sp.AffinityTimeout < time.Second || sp.AffinityTimeout > 86400*time.Second {
			t.Fatalf("%s: affinity timeout %v", sp, sp.AffinityTimeout)
		}
		switch sp.ProxyProtocol {
		case ProxyProtocolNone, ProxyProtocolV1, ProxyProtocolV2:
		default:
			t.Fatalf("%s: proxy protocol %q", sp, sp.ProxyProtocol)
		}
		switch sp.Topology {
		case TopologyNone, TopologyAuto, TopologyPreferSameZone, TopologyPreferSameNode:
		default:
			t.Fatalf("%s: topology %q", sp, sp.Topology)
		}
		if !sp.Equal(sp) {
			t.Fatalf("%s: not equal to itself", sp)
		}
	}
}

func FuzzFromService(f *testing.F) {
	for _, seed := range []string{
		"metadata: {namespace: ns, name: web}\nspec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]}\n",
		"metadata: {namespace: ns, name: web}\nspec:\n  type: LoadBalancer\n  clusterIPs: [10.96.0.10, 'fd00::10']\n  externalIPs: [192.0.2.1, '2001:db8::1']\n" +
			"  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n" +
			"  ports: [{name: a, port: 80, nodePort: 30080}, {name: b, port: 53, protocol: UDP, nodePort: 30053}]\n" +
			"status: {loadBalancer: {ingress: [{ip: 198.51.100.1}, {ip: 198.51.100.2, ipMode: Proxy}, {hostname: lb.example}]}}\n",
		"metadata: {namespace: ns, name: web, annotations: {kube-userspace-proxy.io/proxy-protocol: v2, service.kubernetes.io/topology-mode: Auto}}\n" +
			"spec: {clusterIP: 10.96.0.10, trafficDistribution: PreferSameNode, internalTrafficPolicy: Local, ports: [{port: 80}]}\n",
		// Nasty ones: what the API server would reject (more in testdata/fuzz/FuzzFromService).
		"metadata: {namespace: ns, name: web}\nspec: {type: LoadBalancer, clusterIP: 10.0.0.1, externalTrafficPolicy: Local, healthCheckNodePort: -5, ports: [{port: 80, nodePort: 70000}, {port: 0}, {port: 80, protocol: SCTP}]}\n",
		"metadata: {namespace: ns, name: web}\nspec: {clusterIP: 10.0.0.1, externalIPs: ['1.2.3.4%x', ''], sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}, ports: [{port: 1}, {port: 2}]}\n",
		"metadata: {namespace: ns, name: web}\nspec: {clusterIP: None, ports: [{port: 80}]}\n",
		"metadata: {namespace: ns, name: web}\nspec: {type: ExternalName, externalName: x.example}\n",
		"{}", "null", "[]",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var svc v1.Service
		if err := yaml.Unmarshal(data, &svc); err != nil {
			return
		}
		in := svc.DeepCopy()
		sps, err := FromService(&svc)
		fieldErrorsOf(t, err, "Service "+svc.Namespace+"/"+svc.Name)
		checkServicePorts(t, &svc, sps)
		if !equalJSON(t, in, &svc) {
			t.Fatal("FromService modified the service")
		}
		// The same input gives the same output.
		again, err2 := FromService(in)
		if len(again) != len(sps) || fmt.Sprint(err) != fmt.Sprint(err2) {
			t.Fatalf("second conversion differs: %d ports, %v; first %d ports, %v", len(again), err2, len(sps), err)
		}
		for i := range sps {
			if !sps[i].Equal(again[i]) {
				t.Fatalf("second conversion differs: %v, first %v", again[i], sps[i])
			}
		}
	})
}

// equalJSON compares two objects by their JSON.
func equalJSON(t *testing.T, a, b any) bool {
	t.Helper()
	ja, err := yaml.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	jb, err := yaml.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Equal(ja, jb)
}

func FuzzEndpointsFromSlices(f *testing.F) {
	for _, seed := range []string{
		"metadata: {namespace: ns, name: web-1}\naddressType: IPv4\nports: [{name: http, port: 8080}]\n" +
			"endpoints: [{addresses: [10.0.0.1], nodeName: n1, conditions: {ready: true}}, {addresses: [10.0.0.2], conditions: {ready: false, serving: true, terminating: true}}]\n",
		"metadata: {namespace: ns, name: web-1}\naddressType: IPv6\nports: [{port: 8080}, {name: b, port: 9090, protocol: UDP}]\n" +
			"endpoints: [{addresses: ['fd00::1', 'fd00::2'], hints: {forZones: [{name: z1}], forNodes: [{name: n1}, {name: n1}]}}]\n" +
			"---\nmetadata: {namespace: ns, name: web-2}\naddressType: IPv6\nports: [{port: 8080}]\nendpoints: [{addresses: ['fd00::1'], conditions: {ready: false}}]\n",
		"metadata: {namespace: ns, name: web-1}\naddressType: FQDN\nports: [{port: 80}]\nendpoints: [{addresses: [x.example]}]\n",
		// Nasty ones (more in testdata/fuzz/FuzzEndpointsFromSlices).
		"metadata: {namespace: ns, name: web-1}\naddressType: IPv4\nports: [{port: 0}, {}, {port: 70000}, {port: 80}]\n" +
			"endpoints: [{addresses: ['::ffff:10.0.0.1', 10.0.0.1, '', 10.0.0.300]}, {addresses: []}]\n",
		"metadata: {namespace: ns, name: web-1}\naddressType: IPv4\nports: [{port: 80}]\n" +
			"endpoints: [{addresses: [10.0.0.1], hints: {forZones: [{name: ''}, {name: 'a,b'}], forNodes: [{name: 'N_1'}, {name: 'a,b'}]}}]\n",
		"metadata: {namespace: ns, name: web-1}\nports: [{port: 80}, {port: 81}]\nendpoints: [{addresses: [10.0.0.1, 10.0.0.1]}]\n",
		"{}", "null", "---\n---\n",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var list []*discovery.EndpointSlice
		var objects []string
		for _, doc := range bytes.Split(data, []byte("\n---\n")) {
			s := &discovery.EndpointSlice{}
			if err := yaml.Unmarshal(doc, s); err != nil {
				return
			}
			list = append(list, s)
			objects = append(objects, "EndpointSlice "+s.Namespace+"/"+s.Name)
		}
		in := make([]*discovery.EndpointSlice, len(list))
		for i, s := range list {
			in[i] = s.DeepCopy()
		}
		eps, err := endpointsFromSlices(types.NamespacedName{Namespace: "ns", Name: "web"}, list)
		fieldErrorsOf(t, err, objects...)
		for i := range list {
			if !equalJSON(t, in[i], list[i]) {
				t.Fatal("endpointsFromSlices modified a slice")
			}
		}
		portNames := map[string]bool{}
		for _, s := range list {
			for _, p := range s.Ports {
				if p.Name != nil {
					portNames[*p.Name] = true
				} else {
					portNames[""] = true
				}
			}
		}
		for name, list := range eps {
			if !portNames[name] {
				t.Fatalf("endpoints for port %q, which no slice has", name)
			}
			if len(list) == 0 {
				t.Fatalf("port %q: empty list", name)
			}
			for i, ep := range list {
				checkAddr(t, "endpoint", ep.Addr.Addr())
				if ep.Addr.Port() == 0 {
					t.Fatalf("endpoint %v: port 0", ep)
				}
				if i > 0 && list[i-1].Addr.Compare(ep.Addr) >= 0 {
					t.Fatalf("port %q: endpoints not sorted or not unique: %v", name, list)
				}
				for _, z := range ep.ZoneHints.Names() {
					if z == "" || strings.Contains(z, ",") || len(validation.IsValidLabelValue(z)) > 0 {
						t.Fatalf("endpoint %v: zone hint %q", ep, z)
					}
				}
				for _, n := range ep.NodeHints.Names() {
					if strings.Contains(n, ",") || len(validation.IsDNS1123Subdomain(n)) > 0 {
						t.Fatalf("endpoint %v: node hint %q", ep, n)
					}
				}
			}
		}
		// The same input gives the same output.
		again, err2 := endpointsFromSlices(types.NamespacedName{Namespace: "ns", Name: "web"}, in)
		if fmt.Sprint(again) != fmt.Sprint(eps) || fmt.Sprint(err) != fmt.Sprint(err2) {
			t.Fatalf("second conversion differs: %v, %v; first %v, %v", again, err2, eps, err)
		}
	})
}

// TestFuzzFindings holds what the fuzz targets found in the model, as plain cases.
func TestFuzzFindings(t *testing.T) {
	cases := []struct {
		name      string
		edit      func(*v1.Service)
		wantPorts int
		wantErrs  []string // fields, in order
	}{
		{"cluster IP with an IPv6 zone", func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "fe80::1%eth0", []string{"fe80::1%eth0"} },
			0, []string{"spec.clusterIPs[0]"}},
		{"two cluster IPs of one family", func(s *v1.Service) {
			s.Spec.ClusterIPs = []string{"10.96.0.10", "::ffff:10.96.0.11", "fd00::10", "fd00::11"}
		},
			1, []string{"spec.clusterIPs[1]", "spec.clusterIPs[3]"}},
		{"no namespace", func(s *v1.Service) { s.Namespace = "" }, 0, []string{"metadata.namespace"}},
		{"no name", func(s *v1.Service) { s.Name = "" }, 0, []string{"metadata.name"}},
		{"health check node port out of range", func(s *v1.Service) {
			s.Spec.Type, s.Spec.ExternalTrafficPolicy, s.Spec.HealthCheckNodePort = v1.ServiceTypeLoadBalancer, v1.ServiceExternalTrafficPolicyLocal, -5
		}, 1, []string{"spec.healthCheckNodePort"}},
		{"external and load balancer IPs with zones", func(s *v1.Service) {
			s.Spec.Type = v1.ServiceTypeLoadBalancer
			s.Spec.ExternalIPs = []string{"fe80::1%eth0", "192.0.2.1"}
			s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: "fe80::2%lo"}, {IP: "198.51.100.1"}}
		}, 1, []string{"spec.externalIPs[0]", "status.loadBalancer.ingress[0].ip"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := svc(tc.edit)
			sps, err := FromService(s)
			var got []string
			for _, fe := range fieldErrorsOf(t, err, "Service "+s.Namespace+"/"+s.Name) {
				got = append(got, fe.Field)
			}
			if len(sps) != tc.wantPorts || !slices.Equal(got, tc.wantErrs) {
				t.Fatalf("%d ports, errors %q; want %d, %q", len(sps), got, tc.wantPorts, tc.wantErrs)
			}
			checkServicePorts(t, s, sps)
		})
	}

	slice := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: "web-1"},
		AddressType: discovery.AddressTypeIPv6,
		Ports:       []discovery.EndpointPort{{Port: ptr.To[int32](80)}},
		Endpoints:   []discovery.Endpoint{{Addresses: []string{"fe80::1%eth0", "fd00::1"}}},
	}
	eps, err := endpointsFromSlices(types.NamespacedName{Namespace: "ns", Name: "web"}, []*discovery.EndpointSlice{slice})
	fes := fieldErrorsOf(t, err, "EndpointSlice ns/web-1")
	if len(eps[""]) != 1 || eps[""][0].Addr != netip.MustParseAddrPort("[fd00::1]:80") || len(fes) != 1 || fes[0].Field != "endpoints[0].addresses[0]" {
		t.Errorf("endpoints %v, errors %v; want fd00::1 only and the zone reported", eps, err)
	}
}
