package userspace

import (
	"fmt"
	"net/netip"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/metrics"
)

// churnSlice returns service i's EndpointSlice of the endpoints 10.(128+i/256).(i%256).{first..first+n-1}
// on port 8080, all ready but those in notReady and terminating (by index in the slice).
func churnSlice(i, first, n int, notReady, terminating int) *discovery.EndpointSlice {
	name := fmt.Sprintf("svc%d", i)
	s := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: name + "-1", Labels: map[string]string{discovery.LabelServiceName: name}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To("tcp"), Port: ptr.To[int32](8080), Protocol: ptr.To(v1.ProtocolTCP)}},
	}
	for k := range n {
		ip := netip.AddrFrom4([4]byte{10, byte(128 + i/256), byte(i % 256), byte(1 + (first+k)%250)})
		ready := k != notReady && k != terminating
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{Addresses: []string{ip.String()},
			Conditions: discovery.EndpointConditions{Ready: ptr.To(ready), Serving: ptr.To(k != notReady), Terminating: ptr.To(k == terminating)}})
	}
	return s
}

// churnProxier returns a proxier with n ClusterIP services of one TCP port and eps endpoints
// each, synced.
func churnProxier(b *testing.B, n, eps int) *Proxier {
	p := New(Options{Portals: discardPortals{}, NodeAddrs: noNodeAddrs, BindAddress: netip.MustParseAddr("127.0.0.1"),
		Metrics: metrics.New(metrics.Options{NoRuntimeCollectors: true})})
	p.Tracker().OnSynced()
	b.Cleanup(func() { p.closeListeners() })
	tr := p.Tracker()
	for i := range n {
		svc := service(fmt.Sprintf("svc%d", i), []v1.ServicePort{tcpPort("tcp", 80)})
		svc.Spec.ClusterIP = netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)}).String()
		tr.OnServiceUpdate(nil, svc)
		tr.OnEndpointSliceUpdate(nil, churnSlice(i, 0, eps, -1, -1))
	}
	p.sync(true)
	return p
}

// rollingStep returns the three slices of one step of a rolling update of service i whose
// endpoints start at first: the oldest endpoint terminating, a new one not ready, then ready.
func rollingStep(i, first, eps int) [3]*discovery.EndpointSlice {
	return [3]*discovery.EndpointSlice{
		churnSlice(i, first, eps, -1, 0),
		churnSlice(i, first, eps+1, eps, 0),
		churnSlice(i, first+1, eps, -1, -1),
	}
}

// BenchmarkEndpointChurn measures, at 10,000 services of 10 endpoints each, what one
// EndpointSlice update of a rolling update costs the proxy from the event to the balancer:
// through a rate-limited sync (sync) and through the endpoint-only path that programs it at once
// (endpoints). live-heap reports the live heap per endpoint after the first sync.
func BenchmarkEndpointChurn(b *testing.B) {
	const n, eps = 10_000, 10
	run := func(b *testing.B, apply func(p *Proxier)) {
		p := churnProxier(b, n, eps)
		steps := make([][3]*discovery.EndpointSlice, 64)
		for k := range steps {
			steps[k] = rollingStep(k*97%n, k, eps)
		}
		prev := map[int]*discovery.EndpointSlice{}
		i := 0
		b.ReportAllocs()
		for b.Loop() {
			st := steps[(i/3)%len(steps)]
			svc := ((i / 3) % len(steps)) * 97 % n
			cur := st[i%3]
			p.Tracker().OnEndpointSliceUpdate(prev[svc], cur)
			prev[svc] = cur
			apply(p)
			i++
		}
	}
	b.Run("sync", func(b *testing.B) { run(b, func(p *Proxier) { p.sync(false) }) })
	b.Run("endpoints", func(b *testing.B) { run(b, (*Proxier).programEndpoints) })
	b.Run("live-heap", func(b *testing.B) {
		var perEP float64
		for b.Loop() {
			before, _ := heapAfterGC()
			p := churnProxier(b, n, eps)
			after, _ := heapAfterGC()
			perEP = (float64(after) - float64(before)) / (n * eps)
			p.closeListeners()
		}
		b.ReportMetric(perEP, "B/endpoint")
	})
}
