package loadbalancer

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// evictions records OnAffinityEvicted calls.
type evictions struct {
	mu sync.Mutex
	n  map[string]int // by "name protocol"
}

func (e *evictions) record(name proxy.Name, protocol v1.Protocol) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n == nil {
		e.n = map[string]int{}
	}
	e.n[name.String()+" "+string(protocol)]++
}

func (e *evictions) count(name proxy.Name, protocol v1.Protocol) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n[name.String()+" "+string(protocol)]
}

func (e *evictions) total() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, c := range e.n {
		n += c
	}
	return n
}

// newCappedHarness is newHarness (node thisNode) with at most max affinity entries per service
// port (0: the default), recording evictions.
func newCappedHarness(t *testing.T, max int) (*harness, *evictions) {
	t.Helper()
	ev := &evictions{}
	clock := newFakeClock()
	lb := New(Options{
		NodeName: thisNode, Now: clock.Now, Rand: rand.New(rand.NewPCG(11, 13)),
		MaxAffinityEntries: max, OnAffinityEvicted: ev.record,
	})
	t.Cleanup(func() { checkAffinityTables(t, lb) })
	return &harness{t: t, lb: lb, clock: clock}, ev
}

// tenEndpoints are ten ready endpoints on other nodes.
func tenEndpoints() []proxy.Endpoint {
	var eps []proxy.Endpoint
	for i := range 10 {
		eps = append(eps, ready(fmt.Sprintf("10.0.0.%d", i+1), "n2"))
	}
	return eps
}

func client(i int) string { return fmt.Sprintf("192.168.%d.%d", i>>8, i&0xff) }

// TestAffinityBound checks that a service port's affinity entries are bounded by
// Options.MaxAffinityEntries, the least recently used client going first.
func TestAffinityBound(t *testing.T) {
	svc, other := name("web", "http"), name("web", "https")

	t.Run("cap+N clients leave cap entries, the least recently used evicted", func(t *testing.T) {
		const max = 5
		h, ev := newCappedHarness(t, max)
		h.set(svcPort(svc, withAffinity(time.Hour)), tenEndpoints()...)
		pinned := map[int]proxy.Endpoint{}
		for i := range max {
			pinned[i] = h.next(svc, client(i), false, false)
			h.clock.Advance(time.Second)
		}
		// Use 0 and 2 again: oldest first, the use order is now 1, 3, 4, 0, 2.
		for _, i := range []int{0, 2} {
			if got := h.next(svc, client(i), false, false); got != pinned[i] {
				t.Fatalf("client %d: %v, want %v", i, got, pinned[i])
			}
			h.clock.Advance(time.Second)
		}
		const n = 3
		for i := 100; i < 100+n; i++ {
			h.next(svc, client(i), false, false)
			h.clock.Advance(time.Second)
		}
		if total, _ := h.affinityEntries(svc, netip.AddrPort{}); total != max {
			t.Errorf("%d entries after %d clients, want the cap %d", total, max+n, max)
		}
		for _, i := range []int{1, 3, 4} {
			if ep, ok := h.affinityOf(svc, client(i), false); ok {
				t.Errorf("least recently used client %d kept (%v), want it evicted", i, ep)
			}
		}
		for _, i := range []int{0, 2} {
			if ep, ok := h.affinityOf(svc, client(i), false); !ok || ep != pinned[i].Addr {
				t.Errorf("recently used client %d: entry %v (present %v), want %v", i, ep, ok, pinned[i].Addr)
			}
			if got := h.next(svc, client(i), false, false); got != pinned[i] {
				t.Errorf("recently used client %d: %v, want its endpoint %v", i, got, pinned[i])
			}
		}
		for i := 100; i < 100+n; i++ {
			if _, ok := h.affinityOf(svc, client(i), false); !ok {
				t.Errorf("new client %d has no entry", i)
			}
		}
		if got := ev.count(svc, v1.ProtocolTCP); got != n {
			t.Errorf("%d evictions counted for %s TCP, want %d", got, svc, n)
		}
	})

	t.Run("known clients re-picked do not evict", func(t *testing.T) {
		h, ev := newCappedHarness(t, 3)
		h.set(svcPort(svc, withAffinity(10*time.Second)), tenEndpoints()...)
		for i := range 3 {
			h.next(svc, client(i), false, false)
		}
		h.next(svc, client(0), false, true) // a failed dial: re-picked
		h.clock.Advance(time.Minute)
		h.next(svc, client(1), false, false) // expired: re-picked
		if total, _ := h.affinityEntries(svc, netip.AddrPort{}); total != 3 {
			t.Errorf("%d entries, want 3", total)
		}
		if got := ev.total(); got != 0 {
			t.Errorf("%d evictions, want none", got)
		}
	})

	t.Run("the cap counts both selection rules", func(t *testing.T) {
		h, ev := newCappedHarness(t, 2)
		local := ready("10.0.0.1", thisNode)
		h.set(svcPort(svc, withAffinity(time.Hour), externalLocal), local, ready("10.0.0.2", "n2"))
		h.next(svc, client(0), true, false) // Local rule
		h.clock.Advance(time.Second)
		h.next(svc, client(0), false, false) // cluster-wide rule
		h.clock.Advance(time.Second)
		h.next(svc, client(1), false, false)
		if _, ok := h.affinityOf(svc, client(0), true); ok {
			t.Errorf("oldest entry (client 0, Local rule) kept")
		}
		if _, ok := h.affinityOf(svc, client(0), false); !ok {
			t.Errorf("client 0's cluster-wide entry evicted instead of its older Local one")
		}
		if got := ev.count(svc, v1.ProtocolTCP); got != 1 {
			t.Errorf("%d evictions, want 1", got)
		}
	})

	t.Run("Sweep drops expired entries, the order survives", func(t *testing.T) {
		h, ev := newCappedHarness(t, 4)
		h.set(svcPort(svc, withAffinity(10*time.Second)), tenEndpoints()...)
		h.next(svc, client(0), false, false)
		h.next(svc, client(1), false, false)
		h.clock.Advance(5 * time.Second)
		h.next(svc, client(2), false, false)
		h.clock.Advance(time.Second)
		h.next(svc, client(3), false, false)
		h.clock.Advance(5 * time.Second) // 0 and 1 idle 10s: expired
		h.lb.Sweep()
		if total, _ := h.affinityEntries(svc, netip.AddrPort{}); total != 2 {
			t.Fatalf("%d entries after Sweep, want 2", total)
		}
		h.next(svc, client(4), false, false)
		h.next(svc, client(5), false, false)
		if got := ev.total(); got != 0 {
			t.Fatalf("%d evictions with room left after Sweep, want none", got)
		}
		h.next(svc, client(6), false, false)
		if _, ok := h.affinityOf(svc, client(2), false); ok {
			t.Errorf("client 2, the least recently used, kept")
		}
		for _, i := range []int{3, 4, 5, 6} {
			if _, ok := h.affinityOf(svc, client(i), false); !ok {
				t.Errorf("client %d evicted", i)
			}
		}
		h.clock.Advance(time.Hour)
		h.lb.Sweep()
		if total, _ := h.affinityEntries(svc, netip.AddrPort{}); total != 0 {
			t.Errorf("%d entries after everything expired, want 0", total)
		}
	})

	t.Run("each port has its own cap", func(t *testing.T) {
		h, ev := newCappedHarness(t, 3)
		h.set(svcPort(svc, withAffinity(time.Hour)), tenEndpoints()...)
		h.set(svcPort(other, withAffinity(time.Hour)), tenEndpoints()...)
		for i := range 3 {
			h.next(svc, client(i), false, false)
		}
		for i := range 10 { // a flood on the other port
			h.next(other, client(1000+i), false, false)
		}
		if total, _ := h.affinityEntries(svc, netip.AddrPort{}); total != 3 {
			t.Errorf("%s: %d entries after a flood of %s, want its 3", svc, total, other)
		}
		if total, _ := h.affinityEntries(other, netip.AddrPort{}); total != 3 {
			t.Errorf("%s: %d entries, want the cap 3", other, total)
		}
		if a, b := ev.count(svc, v1.ProtocolTCP), ev.count(other, v1.ProtocolTCP); a != 0 || b != 7 {
			t.Errorf("evictions %s %d, %s %d; want 0 and 7", svc, a, other, b)
		}
	})

	t.Run("endpoint removal keeps the order of the rest", func(t *testing.T) {
		h, _ := newCappedHarness(t, 4)
		eps := tenEndpoints()
		h.set(svcPort(svc, withAffinity(time.Hour)), eps...)
		var gone proxy.Endpoint
		for i := range 4 {
			e := h.next(svc, client(i), false, false)
			if i == 1 {
				gone = e
			}
		}
		var rest []proxy.Endpoint
		for _, e := range eps {
			if e != gone {
				rest = append(rest, e)
			}
		}
		h.set(svcPort(svc, withAffinity(time.Hour)), rest...)
		h.next(svc, client(10), false, false) // fills the slot client 1 left
		h.next(svc, client(11), false, false) // evicts client 0
		if _, ok := h.affinityOf(svc, client(0), false); ok {
			t.Errorf("client 0, the least recently used, kept")
		}
		for _, i := range []int{2, 3, 10, 11} {
			if _, ok := h.affinityOf(svc, client(i), false); !ok {
				t.Errorf("client %d evicted", i)
			}
		}
	})

	t.Run("default cap", func(t *testing.T) {
		h, ev := newCappedHarness(t, 0)
		h.set(svcPort(svc, withAffinity(time.Hour)), tenEndpoints()...)
		for i := range DefaultMaxAffinityEntries + 10 {
			h.next(svc, client(i), false, false)
		}
		if total, _ := h.affinityEntries(svc, netip.AddrPort{}); total != DefaultMaxAffinityEntries {
			t.Errorf("%d entries, want the default cap %d", total, DefaultMaxAffinityEntries)
		}
		if got := ev.count(svc, v1.ProtocolTCP); got != 10 {
			t.Errorf("%d evictions, want 10", got)
		}
	})
}

// TestAffinityBoundConcurrent runs Next for more clients than the bound from many goroutines
// while the port changes, its entries expire and it is deleted; run with -race. The tables must
// stay consistent and within the bound, and no eviction may be reported once DeleteServicePort
// has returned.
func TestAffinityBoundConcurrent(t *testing.T) {
	const max = 16
	svc := name("web", "http")
	clock := newFakeClock()
	var evicted atomic.Int64
	var deleted atomic.Bool
	lateEviction := make(chan struct{}, 1)
	lb := New(Options{
		NodeName: thisNode, Now: clock.Now, Rand: rand.New(rand.NewPCG(3, 4)), MaxAffinityEntries: max,
		OnAffinityEvicted: func(proxy.Name, v1.Protocol) {
			evicted.Add(1)
			if deleted.Load() {
				select {
				case lateEviction <- struct{}{}:
				default:
				}
			}
		},
	})
	eps := tenEndpoints()
	eps[0].NodeName = thisNode
	lb.SetServicePort(svcPort(svc, withAffinity(time.Second)), eps)

	stop := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for g := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				c := netip.AddrFrom4([4]byte{192, 168, byte(g), byte(i % 64)})
				if _, err := lb.Next(svc, c, i%3 == 0, i%11 == 0); err != nil &&
					!errors.Is(err, ErrUnknownServicePort) && !errors.Is(err, ErrNoLocalEndpoints) {
					errs <- err
					return
				}
			}
		})
	}
	for i := range 100 {
		opts := []func(*proxy.ServicePort){withAffinity(time.Duration(1+i%3) * time.Second)}
		if i%4 == 0 {
			opts = append(opts, externalLocal)
		}
		if i%7 == 0 {
			opts = opts[1:]
		}
		lb.SetServicePort(svcPort(svc, opts...), eps[:2+i%8])
		clock.Advance(300 * time.Millisecond)
		lb.Sweep()
		checkAffinityTables(t, lb)
		runtime.Gosched()
	}
	// On a busy machine the clients may not have run much yet: the last setting has affinity
	// with the bound, so let them run until they have evicted (bounded).
	for deadline := time.Now().Add(10 * time.Second); evicted.Load() == 0 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	lb.DeleteServicePort(svc)
	deleted.Store(true)
	time.Sleep(10 * time.Millisecond) // let the goroutines run on against the deleted port
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	select {
	case <-lateEviction:
		t.Error("eviction reported after DeleteServicePort returned")
	default:
	}
	if evicted.Load() == 0 {
		t.Error("no eviction with 256 clients and a bound of 16")
	}
}

// TestAffinityMemoryBounded sends 200,000 distinct (spoofed) clients to one service port with
// affinity and checks that the heap grows by the default cap's worth of entries, not by
// 200,000 entries' worth.
func TestAffinityMemoryBounded(t *testing.T) {
	const clients = 200_000
	svc := name("web", "http")
	lb := New(Options{NodeName: thisNode, Rand: rand.New(rand.NewPCG(1, 2))})
	lb.SetServicePort(svcPort(svc, withAffinity(24*time.Hour)), tenEndpoints())
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	for i := range clients {
		c := netip.AddrFrom4([4]byte{byte(11 + i>>24), byte(i >> 16), byte(i >> 8), byte(i)})
		if _, err := lb.Next(svc, c, true, false); err != nil {
			t.Fatal(err)
		}
	}
	after := heap()
	runtime.KeepAlive(lb)
	growth := int64(after) - int64(before)
	h := &harness{t: t, lb: lb}
	total, _ := h.affinityEntries(svc, netip.AddrPort{})
	t.Logf("%d clients: %d entries kept, heap %d -> %d bytes (%+.1f MiB, %d bytes per entry kept)",
		clients, total, before, after, float64(growth)/(1<<20), growth/int64(max(total, 1)))
	if total != DefaultMaxAffinityEntries {
		t.Errorf("%d entries kept, want the default cap %d", total, DefaultMaxAffinityEntries)
	}
	// 1 KiB per entry is several times what an entry takes; unbounded, 200,000 entries take
	// about 5 times this.
	if limit := int64(DefaultMaxAffinityEntries) << 10; growth > limit {
		t.Errorf("heap grew by %d bytes, want at most %d", growth, limit)
	}
}

// TestAffinityHitAllocs checks that a Next that finds its client's entry allocates nothing.
func TestAffinityHitAllocs(t *testing.T) {
	svc := name("web", "http")
	lb := New(Options{NodeName: thisNode, Rand: rand.New(rand.NewPCG(1, 2)), MaxAffinityEntries: 64})
	lb.SetServicePort(svcPort(svc, withAffinity(time.Hour)), tenEndpoints())
	clients := make([]netip.Addr, 64)
	for i := range clients {
		clients[i] = netip.AddrFrom4([4]byte{192, 168, 0, byte(i)})
		if _, err := lb.Next(svc, clients[i], false, false); err != nil {
			t.Fatal(err)
		}
	}
	i := 0
	if n := testing.AllocsPerRun(1000, func() {
		if _, err := lb.Next(svc, clients[i%len(clients)], false, false); err != nil {
			t.Fatal(err)
		}
		i++
	}); n != 0 {
		t.Errorf("%v allocations per hit, want 0", n)
	}
}

// TestSweepWithoutAffinityAllocatesNothing: the periodic sync sweeps every port; ports without
// session affinity, most of them, cost no allocation.
func TestSweepWithoutAffinityAllocatesNothing(t *testing.T) {
	h := newHarness(t, "n1", 1)
	for i := range 1000 {
		h.set(svcPort(name(fmt.Sprint("svc", i), "http")), ready("10.0.0.1:80", "n1"))
	}
	if n := testing.AllocsPerRun(10, h.lb.Sweep); n != 0 {
		t.Errorf("Sweep of 1,000 ports without affinity: %v allocations, want 0", n)
	}
}
