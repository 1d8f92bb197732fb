package userspace

import (
	"context"
	"fmt"
	"net/netip"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
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

func scaleProxierT(b testing.TB, n int) *Proxier {
	b.Helper()
	p := New(Options{Portals: discardPortals{}, HoldPorts: true, NodeAddrs: noNodeAddrs, BindAddress: netip.MustParseAddr("127.0.0.1")})
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

// BenchmarkProxierSync measures, at 10,000 service ports, the proxier's first sync (every
// listener opened), an idle periodic sync (nothing changed: what the proxy spends every sync
// period), and a sync after one more service.
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
	b.Run("periodic-idle", func(b *testing.B) {
		p := scaleProxier(b, n)
		p.sync(true)
		for b.Loop() {
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
