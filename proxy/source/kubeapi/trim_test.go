package kubeapi

import (
	"fmt"
	"reflect"
	"runtime"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// realService is a Service as an API server serves it after kubectl apply: managed fields, the
// last-applied annotation, and the annotations the proxy reads.
func realService() *v1.Service {
	return &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web", UID: "u1", ResourceVersion: "12",
			Labels: map[string]string{"app": "web"},
			Annotations: map[string]string{
				"kubectl.kubernetes.io/last-applied-configuration": `{"apiVersion":"v1","kind":"Service","metadata":{"name":"web"}}`,
				proxy.ProxyProtocolAnnotation:                      "v2",
				v1.AnnotationTopologyMode:                          "Auto",
			},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl", Operation: metav1.ManagedFieldsOperationApply}}},
		Spec: v1.ServiceSpec{Type: v1.ServiceTypeNodePort, ClusterIP: "10.96.0.10", ClusterIPs: []string{"10.96.0.10"},
			IPFamilies: []v1.IPFamily{v1.IPv4Protocol}, ExternalTrafficPolicy: v1.ServiceExternalTrafficPolicyLocal,
			HealthCheckNodePort: 31000, SessionAffinity: v1.ServiceAffinityClientIP,
			Ports: []v1.ServicePort{{Name: "http", Protocol: v1.ProtocolTCP, Port: 80, NodePort: 30080}}},
		Status: v1.ServiceStatus{LoadBalancer: v1.LoadBalancerStatus{Ingress: []v1.LoadBalancerIngress{{IP: "192.0.2.7"}}}},
	}
}

// realSlice is an EndpointSlice as the EndpointSlice controller writes it.
func realSlice(name string, endpoints int) *discovery.EndpointSlice {
	s := &discovery.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: name, UID: types.UID(name + "-uid"), ResourceVersion: "13",
			Labels: map[string]string{discovery.LabelServiceName: "web", discovery.LabelManagedBy: "endpointslice-controller.k8s.io"},
			Annotations: map[string]string{"endpoints.kubernetes.io/last-change-trigger-time": "2026-11-25T10:00:00Z",
				"example.com/other": "x"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Service", Name: "web", UID: "u1",
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true)}},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kube-controller-manager", Operation: metav1.ManagedFieldsOperationUpdate}}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To("http"), Protocol: ptr.To(v1.ProtocolTCP), Port: ptr.To[int32](8080)}},
	}
	for i := range endpoints {
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{
			Addresses:  []string{fmt.Sprintf("10.244.%d.%d", i/200, i%200+2)},
			Conditions: discovery.EndpointConditions{Ready: ptr.To(i%3 != 0), Serving: ptr.To(true), Terminating: ptr.To(false)},
			Hostname:   ptr.To(fmt.Sprintf("web-%d", i)),
			TargetRef: &v1.ObjectReference{Kind: "Pod", Namespace: "shop", Name: fmt.Sprintf("web-7d9f8-%05d", i),
				UID: types.UID(fmt.Sprintf("pod-uid-%d", i))},
			NodeName:           ptr.To(fmt.Sprintf("node-%d", i%4)),
			Zone:               ptr.To("zone-a"),
			Hints:              &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: "zone-a"}}},
			DeprecatedTopology: map[string]string{"kubernetes.io/hostname": "node-1"},
		})
	}
	return s
}

// TestTrimObjectKeepsWhatTheProxyReads trims objects as the informers do and checks that they
// lost what they should, and that the proxy derives exactly the same service ports, endpoints
// and node eligibility from them as from the whole objects.
func TestTrimObjectKeepsWhatTheProxyReads(t *testing.T) {
	svc := realService()
	wantPorts, err := proxy.FromService(svc)
	if err != nil {
		t.Fatal(err)
	}
	trimmed, _ := trimObject(svc.DeepCopy())
	tsvc := trimmed.(*v1.Service)
	if tsvc.ManagedFields != nil || len(tsvc.Annotations) != 2 || tsvc.Annotations[proxy.ProxyProtocolAnnotation] != "v2" ||
		tsvc.Annotations[v1.AnnotationTopologyMode] != "Auto" {
		t.Errorf("trimmed service: managedFields %v, annotations %v", tsvc.ManagedFields, tsvc.Annotations)
	}
	gotPorts, err := proxy.FromService(tsvc)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(gotPorts, wantPorts) {
		t.Errorf("service ports from the trimmed service differ:\n got %+v\nwant %+v", gotPorts, wantPorts)
	}

	slice := realSlice("web-abc", 5)
	name := types.NamespacedName{Namespace: "shop", Name: "web"}
	wantEps, err := endpointsOf([]*discovery.EndpointSlice{slice})
	if err != nil {
		t.Fatal(err)
	}
	trimmed, _ = trimObject(slice.DeepCopy())
	tslice := trimmed.(*discovery.EndpointSlice)
	if tslice.ManagedFields != nil || len(tslice.Annotations) != 1 || tslice.OwnerReferences != nil ||
		tslice.Annotations[v1.EndpointsLastChangeTriggerTime] != "2026-11-25T10:00:00Z" {
		t.Errorf("trimmed slice metadata: %+v", tslice.ObjectMeta)
	}
	for i, e := range tslice.Endpoints {
		if e.TargetRef != nil || e.Hostname != nil || e.DeprecatedTopology != nil {
			t.Errorf("trimmed slice endpoint %d: %+v", i, e)
		}
	}
	if got, ok := proxy.SliceServiceName(tslice); !ok || got != name {
		t.Errorf("trimmed slice's service = %v, %v", got, ok)
	}
	gotEps, err := endpointsOf([]*discovery.EndpointSlice{tslice})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(gotEps, wantEps) {
		t.Errorf("endpoints from the trimmed slice differ:\n got %+v\nwant %+v", gotEps, wantEps)
	}

	now := metav1.Now()
	node := &v1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-1", Labels: map[string]string{v1.LabelTopologyZone: "zone-a"},
			Annotations: map[string]string{"node.alpha.kubernetes.io/ttl": "0"}, DeletionTimestamp: &now},
		Spec:   v1.NodeSpec{Taints: []v1.Taint{{Key: TaintToBeDeleted, Effect: v1.TaintEffectNoSchedule}}},
		Status: v1.NodeStatus{Images: []v1.ContainerImage{{Names: []string{"registry.example/app:1"}, SizeBytes: 1 << 20}}},
	}
	trimmed, _ = trimObject(node.DeepCopy())
	tnode := trimmed.(*v1.Node)
	if tnode.Annotations != nil || !reflect.DeepEqual(tnode.Status, v1.NodeStatus{}) {
		t.Errorf("trimmed node: annotations %v, status %+v", tnode.Annotations, tnode.Status)
	}
	if tnode.Labels[v1.LabelTopologyZone] != "zone-a" || NodeEligible(tnode) != NodeEligible(node) || len(tnode.Spec.Taints) != 1 {
		t.Errorf("trimmed node lost what the proxy reads: %+v", tnode)
	}
	tnode.DeletionTimestamp = nil
	node.DeletionTimestamp = nil
	if NodeEligible(tnode) != NodeEligible(node) {
		t.Errorf("eligibility of the trimmed node differs")
	}
}

// TestKeepAnnotations covers the three outcomes: all kept (the same map), none (nil), some (a
// new map with only those).
func TestKeepAnnotations(t *testing.T) {
	keep := []string{"a", "b"}
	all := map[string]string{"a": "1", "b": "2"}
	if got := keepAnnotations(all, keep); reflect.ValueOf(got).Pointer() != reflect.ValueOf(all).Pointer() {
		t.Errorf("all kept: got a new map %v", got)
	}
	if got := keepAnnotations(map[string]string{"c": "3"}, keep); got != nil {
		t.Errorf("none kept: got %v, want nil", got)
	}
	if got := keepAnnotations(nil, keep); got != nil {
		t.Errorf("nil: got %v, want nil", got)
	}
	some := map[string]string{"a": "1", "c": "3"}
	if got := keepAnnotations(some, keep); !reflect.DeepEqual(got, map[string]string{"a": "1"}) || len(some) != 2 {
		t.Errorf("some kept: got %v (input now %v)", got, some)
	}
}

// BenchmarkTrimmedSliceMemory reports what the informer's cache holds per EndpointSlice of 10
// endpoints as the EndpointSlice controller writes them, whole and trimmed (B/slice, the live
// heap after a collection, 2,000 slices).
func BenchmarkTrimmedSliceMemory(b *testing.B) {
	for _, trim := range []bool{false, true} {
		b.Run(fmt.Sprintf("trimmed=%v", trim), func(b *testing.B) {
			const n = 2000
			var per float64
			for b.Loop() {
				before := heapLive()
				held := make([]*discovery.EndpointSlice, n)
				for i := range held {
					s := realSlice(fmt.Sprintf("web-%d", i), 10)
					if trim {
						o, _ := trimObject(s)
						s = o.(*discovery.EndpointSlice)
					}
					held[i] = s
				}
				per = float64(heapLive()-before) / n
				runtime.KeepAlive(held)
			}
			b.ReportMetric(per, "B/slice")
		})
	}
}

func heapLive() int64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// TestPackedRoundTrip: what the informers cache for a Service and an EndpointSlice is packed
// (identity and encoding, no decoded object), keyed as the object would be, and unpacks into
// the trimmed object; a Node is cached as it is. The event handler takes both forms.
func TestPackedRoundTrip(t *testing.T) {
	for _, obj := range []any{realService(), realSlice("web-abc", 5)} {
		trimmed, _ := trimObject(obj.(kruntime.Object).DeepCopyObject())
		got, err := trimAndPack(obj)
		if err != nil {
			t.Fatal(err)
		}
		p, ok := got.(*packed)
		if !ok {
			t.Fatalf("%T cached as %T, want *packed", obj, got)
		}
		key, err := cache.MetaNamespaceKeyFunc(p)
		if want, _ := cache.MetaNamespaceKeyFunc(trimmed); err != nil || key != want {
			t.Errorf("packed key %q (%v), want %q", key, err, want)
		}
		if m := trimmed.(metav1.Object); p.GetResourceVersion() != m.GetResourceVersion() || p.GetUID() != m.GetUID() || p.GetUID() == "" {
			t.Errorf("packed identity: %+v", p)
		}
		var back any
		switch trimmed.(type) {
		case *v1.Service:
			back, err = unpack[v1.Service](p)
		case *discovery.EndpointSlice:
			back, err = unpack[discovery.EndpointSlice](p)
		}
		if err != nil || !equality.Semantic.DeepEqual(back, trimmed) {
			t.Errorf("%T unpacks into %+v (%v), want the trimmed %+v", obj, back, err, trimmed)
		}
		if c := p.DeepCopyObject().(*packed); &c.pb[0] != &p.pb[0] || c.GetName() != p.GetName() || c == p {
			t.Errorf("a deep copy of a packed object: %+v", c)
		}
	}
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}}
	if got, _ := trimAndPack(node); got != any(node) {
		t.Errorf("a Node is cached as %T", got)
	}

	// The handler delivers the decoded object for a packed one, tombstones included.
	var delivered []*discovery.EndpointSlice
	h := &eventHandler[discovery.EndpointSlice]{kind: "EndpointSlice", d: &dispatcher{}, unpack: unpack[discovery.EndpointSlice],
		deliver: func(prev, cur *discovery.EndpointSlice) { delivered = append(delivered, prev, cur) }}
	p, _ := trimAndPack(realSlice("web-abc", 2))
	h.OnAdd(p, false)
	h.OnDelete(cache.DeletedFinalStateUnknown{Key: "shop/web-abc", Obj: p})
	if len(delivered) != 4 || delivered[0] != nil || delivered[1] == nil || delivered[1].Name != "web-abc" || len(delivered[1].Endpoints) != 2 ||
		delivered[2] == nil || delivered[2].Name != "web-abc" || delivered[3] != nil {
		t.Errorf("delivered %+v", delivered)
	}
}

// endpointsOf merges one service's EndpointSlices into endpoints per port name, as the Tracker
// does (proxy.FromSlice per slice, then proxy.MergeSlices).
func endpointsOf(slices []*discovery.EndpointSlice) (map[string][]proxy.Endpoint, error) {
	each := make([]proxy.SliceEndpoints, 0, len(slices))
	for _, s := range slices {
		if s != nil {
			each = append(each, proxy.FromSlice(s))
		}
	}
	eps, err := proxy.MergeSlices(each)
	out := make(map[string][]proxy.Endpoint, len(eps))
	for _, pe := range eps {
		out[pe.Port] = pe.Endpoints
	}
	return out, err
}
