package userspace

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/metrics"
)

// discardPortals is Portals that programs nothing: the benchmarks below measure the proxier's
// own share of a sync (portal.BenchmarkSyncInNamespace measures the rules).
type discardPortals struct{}

func (discardPortals) Sync(context.Context, []proxy.PortState, proxy.NodeAddrs, bool) error {
	return nil
}

// scaleProxier returns a proxier fed with n ClusterIP services of one TCP port and one
// endpoint each (not yet synced).
func scaleProxier(b *testing.B, n int) *Proxier { return scaleProxierT(b, n) }

func scaleProxierT(b testing.TB, n int) *Proxier { return scaleProxierM(b, n, nil) }

// scaleProxierM is scaleProxierT with m as the traffic metrics (nil: none).
func scaleProxierM(b testing.TB, n int, m TrafficMetrics) *Proxier {
	b.Helper()
	p := New(Options{Portals: discardPortals{}, HoldPorts: true, NodeAddrs: noNodeAddrs, BindAddress: netip.MustParseAddr("127.0.0.1"),
		Metrics: m})
	p.Tracker().OnSynced()
	b.Cleanup(func() {
		p.closeListeners()
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_ = p.Shutdown(ctx)
	})
	be := &backend{name: "b", addr: netip.MustParseAddrPort("127.0.0.1:9")}
	tr := p.Tracker()
	for i := range n {
		name := fmt.Sprintf("svc%d", i)
		svc := service(name, []v1.ServicePort{tcpPort("tcp", 80)})
		svc.Spec.ClusterIP = netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)}).String()
		tr.OnServiceUpdate(nil, svc)
		tr.OnEndpointSliceUpdate(nil, slice(name, name+"-1", "tcp", v1.ProtocolTCP, be))
	}
	return p
}

// heapAfterGC returns, after a collection, the bytes of live objects and of the heap's spans in
// use (live objects plus the free slots of partly used spans).
func heapAfterGC() (live, inuse uint64) {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc, ms.HeapInuse
}

// BenchmarkProxierSync measures, at 10,000 service ports, the proxier's first sync (every
// listener opened), an idle periodic sync (nothing changed: what the proxy spends every sync
// period), the periodic sync that also checks every port's endpoints (the first after a
// start), and a sync after one more service. live-heap is the first sync with the traffic
// metrics the proxy has, reporting B/port: the live heap the sync adds (listeners, forwarders,
// their metrics sinks, the proxier's maps, the balancer's state), per port.
func BenchmarkProxierSync(b *testing.B) {
	const n = 10_000
	b.Run("first", func(b *testing.B) {
		for b.Loop() {
			b.StopTimer()
			p := scaleProxier(b, n)
			b.StartTimer()
			p.sync(true)
			b.StopTimer()
			p.closeListeners()
			b.StartTimer()
		}
	})
	b.Run("live-heap", func(b *testing.B) {
		var perPort, inusePerPort float64
		for b.Loop() {
			b.StopTimer()
			p := scaleProxierM(b, n, metrics.New(metrics.Options{NoRuntimeCollectors: true}))
			before, inuseBefore := heapAfterGC()
			b.StartTimer()
			p.sync(true)
			b.StopTimer()
			after, inuseAfter := heapAfterGC()
			perPort = (float64(after) - float64(before)) / n
			inusePerPort = (float64(inuseAfter) - float64(inuseBefore)) / n
			p.closeListeners()
			b.StartTimer()
		}
		b.ReportMetric(perPort, "B/port")
		// In use: the heap's spans holding objects, with the free slots the sync's garbage left
		// between them.
		b.ReportMetric(inusePerPort, "inuse-B/port")
	})
	b.Run("periodic-idle", func(b *testing.B) {
		p := scaleProxier(b, n)
		p.sync(true)
		for b.Loop() {
			p.sync(true)
		}
	})
	b.Run("periodic-recheck", func(b *testing.B) {
		// The first periodic sync after a start (or a change of listeners) checks every
		// port's endpoints against the proxy's own addresses.
		p := scaleProxier(b, n)
		p.sync(false)
		for b.Loop() {
			p.recheckGen--
			p.sync(true)
		}
	})
	b.Run("one-more-service", func(b *testing.B) {
		p := scaleProxier(b, n)
		p.sync(true)
		be := &backend{name: "b", addr: netip.MustParseAddrPort("127.0.0.1:9")}
		i := 0
		for b.Loop() {
			name := fmt.Sprintf("more%d", i)
			i++
			svc := service(name, []v1.ServicePort{tcpPort("tcp", 80)})
			svc.Spec.ClusterIP = netip.AddrFrom4([4]byte{10, 97, byte(i >> 8), byte(i)}).String()
			p.Tracker().OnServiceUpdate(nil, svc)
			p.Tracker().OnEndpointSliceUpdate(nil, slice(name, name+"-1", "tcp", v1.ProtocolTCP, be))
			p.sync(false)
		}
	})
}
