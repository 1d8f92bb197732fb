package kubeapi

import (
	"context"
	"fmt"
	goruntime "runtime"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"
)

// syncedHandler keeps nothing and signals OnSynced.
type syncedHandler struct{ synced chan struct{} }

func (syncedHandler) OnServiceUpdate(_, _ *v1.Service)                    {}
func (syncedHandler) OnEndpointSliceUpdate(_, _ *discovery.EndpointSlice) {}
func (h syncedHandler) OnSynced()                                         { close(h.synced) }

// BenchmarkInformerCacheMemory reports what the source's informers hold per service (a Service
// of one port and its EndpointSlice of one endpoint, as the API server and the EndpointSlice
// controller write them) once synced, the Handler keeping nothing: the live heap after a
// collection, less the one before Run (the fake API server's own copies are in both).
func BenchmarkInformerCacheMemory(b *testing.B) {
	const n = 2000
	var objs []runtime.Object
	for i := range n {
		name := fmt.Sprintf("s%d", i)
		objs = append(objs, &v1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: "scale", Name: name, UID: "0b6f5f8e-6a4b-4f57-9a3e-0c0f1d2e3f40", ResourceVersion: fmt.Sprint(1000 + i),
				CreationTimestamp: metav1.Now()},
			Spec: v1.ServiceSpec{Type: v1.ServiceTypeClusterIP, ClusterIP: fmt.Sprintf("10.96.%d.%d", i/250, i%250+1),
				ClusterIPs: []string{fmt.Sprintf("10.96.%d.%d", i/250, i%250+1)}, IPFamilies: []v1.IPFamily{v1.IPv4Protocol},
				IPFamilyPolicy: ptr.To(v1.IPFamilyPolicySingleStack), SessionAffinity: v1.ServiceAffinityNone,
				InternalTrafficPolicy: ptr.To(v1.ServiceInternalTrafficPolicyCluster),
				Ports:                 []v1.ServicePort{{Name: "tcp", Port: 80, Protocol: v1.ProtocolTCP}}},
		}, &discovery.EndpointSlice{
			ObjectMeta: metav1.ObjectMeta{Namespace: "scale", Name: name + "-abcde", UID: "1c7e6f9f-7b5c-4068-8b4f-1d1e2f3a4b51", ResourceVersion: fmt.Sprint(5000 + i),
				CreationTimestamp: metav1.Now(),
				Labels:            map[string]string{discovery.LabelServiceName: name, discovery.LabelManagedBy: "endpointslice-controller.k8s.io"}},
			AddressType: discovery.AddressTypeIPv4,
			Ports:       []discovery.EndpointPort{{Name: ptr.To("tcp"), Port: ptr.To[int32](8080), Protocol: ptr.To(v1.ProtocolTCP)}},
			Endpoints: []discovery.Endpoint{{Addresses: []string{fmt.Sprintf("10.244.%d.%d", i/250, i%250+1)},
				Conditions: discovery.EndpointConditions{Ready: ptr.To(true), Serving: ptr.To(true), Terminating: ptr.To(false)},
				NodeName:   ptr.To("node-1")}},
		})
	}
	var perService float64
	for b.Loop() {
		b.StopTimer()
		client := fake.NewClientset(objs...)
		goruntime.GC()
		var before goruntime.MemStats
		goruntime.ReadMemStats(&before)
		ctx, cancel := context.WithCancel(context.Background())
		h := syncedHandler{synced: make(chan struct{})}
		done := make(chan error, 1)
		b.StartTimer()
		go func() { done <- New(clientsetClient{client}, Options{}).Run(ctx, h) }()
		select {
		case <-h.synced:
		case <-time.After(time.Minute):
			b.Fatal("no initial sync")
		}
		b.StopTimer()
		goruntime.GC()
		var after goruntime.MemStats
		goruntime.ReadMemStats(&after)
		perService = (float64(after.HeapAlloc) - float64(before.HeapAlloc)) / n
		cancel()
		<-done
		b.StartTimer()
	}
	b.ReportMetric(perService, "B/service")
}
