package loadbalancer

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// benchClients is how many distinct client IPs the affinity benchmarks rotate through; after the
// first lap every pick is an affinity hit.
const benchClients = 1024

// BenchmarkNext measures Next: without and with ClientIP affinity, over 1, 10 and 100 endpoints,
// from one goroutine and from GOMAXPROCS goroutines on the same service port. Other service
// ports are set too, so the port lookup works on a realistically sized map.
func BenchmarkNext(b *testing.B) {
	clients := make([]netip.Addr, benchClients)
	for i := range clients {
		clients[i] = netip.AddrFrom4([4]byte{192, 168, byte(i >> 8), byte(i)})
	}
	for _, affinity := range []bool{false, true} {
		for _, n := range []int{1, 10, 100} {
			lb := New(Options{NodeName: thisNode, Rand: rand.New(rand.NewPCG(1, 2))})
			svc := name("bench", "http")
			var eps []proxy.Endpoint
			for i := range n {
				eps = append(eps, ready(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}).String(), "n1"))
			}
			opts := []func(*proxy.ServicePort){}
			if affinity {
				opts = append(opts, withAffinity(time.Hour))
			}
			lb.SetServicePort(svcPort(svc, opts...), eps)
			for i := range 1000 {
				lb.SetServicePort(svcPort(name(fmt.Sprintf("other-%d", i), "http")), eps[:1])
			}
			for _, c := range clients { // warm the affinity table
				if _, err := lb.Next(svc, c, false, false); err != nil {
					b.Fatal(err)
				}
			}

			prefix := fmt.Sprintf("affinity=%v/endpoints=%d", affinity, n)
			b.Run(prefix+"/serial", func(b *testing.B) {
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					if _, err := lb.Next(svc, clients[i%benchClients], false, false); err != nil {
						b.Fatal(err)
					}
					i++
				}
			})
			b.Run(prefix+"/parallel", func(b *testing.B) {
				b.ReportAllocs()
				var seq atomic.Int64
				b.RunParallel(func(pb *testing.PB) {
					i := int(seq.Add(1)) * 97
					for pb.Next() {
						if _, err := lb.Next(svc, clients[i%benchClients], false, false); err != nil {
							b.Error(err)
							return
						}
						i++
					}
				})
			})
		}
	}
}

// BenchmarkNextHeld measures picks of a 10-endpoint port while 9 endpoints are held (a
// scale-down whose pods stopped before their EndpointSlices said so): each pick passes over the
// held ones in rotation. The fake clock stands still, so the holds last the whole run.
func BenchmarkNextHeld(b *testing.B) {
	clock := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	lb := New(Options{NodeName: thisNode, Now: func() time.Time { return clock }, Rand: rand.New(rand.NewPCG(1, 2))})
	svc := name("bench", "http")
	var eps []proxy.Endpoint
	for i := range 10 {
		eps = append(eps, ready(netip.AddrFrom4([4]byte{10, 1, 0, byte(i)}).String(), "n1"))
	}
	lb.SetServicePort(svcPort(svc), eps)
	for _, e := range eps[1:] {
		lb.Unreachable(svc, e.Addr)
	}
	b.ReportAllocs()
	for b.Loop() {
		ep, err := lb.Next(svc, netip.Addr{}, false, false)
		if err != nil || ep.Addr != eps[0].Addr {
			b.Fatalf("Next: %v, %v; want the one endpoint not held", ep.Addr, err)
		}
	}
}

// BenchmarkSetServicePort measures an endpoint update of a 100-endpoint port (one endpoint
// replaced), with affinity entries to prune.
func BenchmarkSetServicePort(b *testing.B) {
	lb := New(Options{NodeName: thisNode, Rand: rand.New(rand.NewPCG(1, 2))})
	svc := name("bench", "http")
	sp := svcPort(svc, withAffinity(time.Hour))
	var eps []proxy.Endpoint
	for i := range 101 {
		eps = append(eps, ready(netip.AddrFrom4([4]byte{10, 1, 0, byte(i)}).String(), "n1"))
	}
	lb.SetServicePort(sp, eps[:100])
	for i := range benchClients {
		if _, err := lb.Next(svc, netip.AddrFrom4([4]byte{192, 168, byte(i >> 8), byte(i)}), false, false); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		lb.SetServicePort(sp, eps[i%2:100+i%2])
		i++
	}
}

// BenchmarkAffinityChurn measures Next for a stream of new clients on a port whose affinity
// table is full (a flood of spoofed sources): each pick evicts the least recently used entry.
func BenchmarkAffinityChurn(b *testing.B) {
	var evicted int
	lb := New(Options{NodeName: thisNode, Rand: rand.New(rand.NewPCG(1, 2)), OnAffinityEvicted: func(proxy.Name, v1.Protocol) { evicted++ }})
	svc := name("bench", "http")
	var eps []proxy.Endpoint
	for i := range 10 {
		eps = append(eps, ready(netip.AddrFrom4([4]byte{10, 1, 0, byte(i)}).String(), "n1"))
	}
	lb.SetServicePort(svcPort(svc, withAffinity(time.Hour)), eps)
	i := uint32(0)
	next := func() {
		c := netip.AddrFrom4([4]byte{byte(11 + i>>24), byte(i >> 16), byte(i >> 8), byte(i)})
		if _, err := lb.Next(svc, c, false, false); err != nil {
			b.Fatal(err)
		}
		i++
	}
	for range DefaultMaxAffinityEntries {
		next()
	}
	b.ReportAllocs()
	for b.Loop() {
		next()
	}
	if evicted == 0 {
		b.Fatal("nothing evicted")
	}
}

// BenchmarkMemoryPerPort reports the live heap the balancer holds per service port ("B/port",
// runtime.MemStats.HeapAlloc after a collection) once 10,000 ports of one TCP port and one ready
// endpoint each are set: the endpoint on another node (remote) or on this one (local). The
// ServicePorts and endpoint lists, which the caller owns, are built before the first reading.
func BenchmarkMemoryPerPort(b *testing.B) {
	const ports = 10000
	for _, node := range []string{"remote", thisNode} {
		sps := make([]*proxy.ServicePort, ports)
		eps := make([][]proxy.Endpoint, ports)
		for i := range ports {
			sps[i] = svcPort(name(fmt.Sprintf("svc-%05d", i), ""))
			eps[i] = []proxy.Endpoint{ready(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}).String()+":8080", node)}
		}
		label := "remote"
		if node == thisNode {
			label = "local"
		}
		b.Run("endpoint="+label, func(b *testing.B) {
			var perPort float64
			for b.Loop() {
				perPort = float64(balancerHeap(sps, eps)) / ports
			}
			b.ReportMetric(perPort, "B/port")
		})
	}
}

// BenchmarkMemoryPerEndpoint reports the live heap the balancer holds per endpoint ("B/endpoint",
// runtime.MemStats.HeapAlloc after a collection) at 1,000 ports of 10 endpoints each, all ready
// or one of each port's terminating (a rolling update's step, which narrows the usable list). The
// endpoint lists, which the caller owns, are built before the first reading.
func BenchmarkMemoryPerEndpoint(b *testing.B) {
	const ports, perPort = 1000, 10
	sps := make([]*proxy.ServicePort, ports)
	for i := range ports {
		sps[i] = svcPort(name(fmt.Sprintf("svc-%05d", i), ""))
	}
	for _, terminating := range []bool{false, true} {
		eps := make([][]proxy.Endpoint, ports)
		for i := range ports {
			for k := range perPort {
				e := ready(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), byte(k)}).String()+":8080", "n2")
				if terminating && k == 0 {
					e.Ready, e.Terminating = false, true
				}
				eps[i] = append(eps[i], e)
			}
		}
		b.Run(fmt.Sprintf("terminating=%v", terminating), func(b *testing.B) {
			var perEndpoint float64
			for b.Loop() {
				perEndpoint = float64(balancerHeap(sps, eps)) / (ports * perPort)
			}
			b.ReportMetric(perEndpoint, "B/endpoint")
		})
	}
}

// BenchmarkRollingUpdate measures SetServicePort for the steps of a rolling update of a port of
// 10 endpoints, as the endpoint churn makes them (the oldest endpoint terminating; a new one not
// ready; ready; the terminating one gone), each step a new list as the proxy's are: allocs/op is
// per update.
func BenchmarkRollingUpdate(b *testing.B) {
	lb := New(Options{NodeName: thisNode, Rand: rand.New(rand.NewPCG(1, 2))})
	sp := svcPort(name("bench", "http"))
	ep := func(k int) proxy.Endpoint {
		return ready(netip.AddrFrom4([4]byte{10, 1, byte(k >> 8), byte(k)}).String()+":8080", "n2")
	}
	// steps[s] is step s of the update that begins with endpoints first..first+9 (mod 256).
	const cycle = 64
	var steps [][]proxy.Endpoint
	for first := range cycle {
		for step := range 4 {
			var eps []proxy.Endpoint
			n := 10
			if step == 1 || step == 2 {
				n = 11
			}
			lo := first
			if step == 3 {
				lo++
			}
			for k := lo; k < lo+n; k++ {
				e := ep(k % cycle)
				switch {
				case step < 3 && k == first:
					e.Ready, e.Terminating = false, true
				case step == 1 && k == first+10:
					e.Ready, e.Serving = false, false
				}
				eps = append(eps, e)
			}
			steps = append(steps, eps)
		}
	}
	lb.SetServicePort(sp, steps[len(steps)-1])
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		lb.SetServicePort(sp, steps[i%len(steps)])
		i++
	}
}

// balancerHeap returns the live heap (runtime.MemStats.HeapAlloc after a collection) of a
// balancer given the service ports sps with the endpoint lists eps, which the caller owns and
// which are not counted.
func balancerHeap(sps []*proxy.ServicePort, eps [][]proxy.Endpoint) int64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	lb := New(Options{NodeName: thisNode, Rand: rand.New(rand.NewPCG(1, 2))})
	for i := range sps {
		lb.SetServicePort(sps[i], eps[i])
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(lb)
	return int64(after.HeapAlloc) - int64(before.HeapAlloc)
}
