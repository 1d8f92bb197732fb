package userspace

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
)

// TestPartialSyncStateMatchesRebuild changes services and endpoints at random, each change
// followed by a partial sync, and checks after each that what the proxier keeps up to date
// incrementally — the listeners in name order, the proxy's own addresses, every port's state —
// is what building it from scratch gives.
func TestPartialSyncStateMatchesRebuild(t *testing.T) {
	for seed := range uint64(4) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 11))
			p := newTestProxier(t, Options{Portals: &recordingPortals{}, NodeAddrs: noNodeAddrs, BindAddress: netip.MustParseAddr("127.0.0.1")})
			tr := p.Tracker()
			be := []*backend{
				{name: "a", addr: netip.MustParseAddrPort("10.1.0.1:8080")},
				{name: "b", addr: netip.MustParseAddrPort("127.0.0.1:9")},
				{name: "c", addr: netip.MustParseAddrPort("10.96.0.3:80")}, // a cluster IP: refused when a service has it
			}
			svcs := map[string]*v1.Service{}
			p.sync(true)
			// Many services in one sync (their listeners merged into the sorted list at once),
			// twice, the second batch's names between the first's, all of them between the
			// random steps' ones.
			for batch := range 2 {
				for i := range 80 {
					if (i/3)%2 != batch {
						continue
					}
					name := fmt.Sprintf("m%02d", i) // the first batch has the last
					svc := service(name, []v1.ServicePort{tcpPort("tcp", 80), udpPort("dns", 53)}, func(s *v1.Service) {
						s.Spec.ClusterIP = fmt.Sprintf("10.96.1.%d", 1+i)
					})
					tr.OnServiceUpdate(nil, svc)
				}
				p.sync(false)
				checkIncrementalState(t, p, fmt.Sprintf("batch %d of 40 services", batch))
			}
			for step := range 120 {
				name := fmt.Sprintf("s%d", r.IntN(12))
				var what string
				switch old := svcs[name]; r.IntN(4) {
				case 0:
					if old != nil {
						tr.OnServiceUpdate(old, nil)
						delete(svcs, name)
						what = "deleted " + name
						break
					}
					fallthrough
				case 1, 2:
					ports := []v1.ServicePort{tcpPort("tcp", 80)}
					if r.IntN(3) == 0 {
						ports = append(ports, udpPort("tcp2", 81)) // "tcp2": a protocol change when it goes
					}
					if r.IntN(3) == 0 {
						ports[0].NodePort = int32(30000 + r.IntN(3))
					}
					svc := service(name, ports, func(s *v1.Service) {
						s.Spec.ClusterIP = fmt.Sprintf("10.96.0.%d", 1+r.IntN(30)) // now and then shared: a collision
						if ports[0].NodePort != 0 {
							s.Spec.Type = v1.ServiceTypeNodePort
						}
					})
					tr.OnServiceUpdate(old, svc)
					svcs[name] = svc
					what = "set " + name
				default:
					sl := slice(name, name+"-1", "tcp", v1.ProtocolTCP, be[r.IntN(len(be))])
					tr.OnEndpointSliceUpdate(nil, sl)
					what = "endpoints of " + name
				}
				p.sync(false)
				checkIncrementalState(t, p, fmt.Sprintf("step %d (%s)", step, what))
			}
		})
	}
}

func checkIncrementalState(t *testing.T, p *Proxier, at string) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	var got, want []string
	for _, l := range p.sorted {
		got = append(got, l.key)
	}
	for _, l := range p.ports {
		want = append(want, l.key)
	}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("%s: listeners in order %v, want %v", at, got, want)
	}
	if !p.self.collided {
		fresh := newSelfAddrs(p.ports, p.self.node)
		if !maps.Equal(p.self.portals, fresh.portals) || !maps.Equal(p.self.ports, fresh.ports) {
			t.Fatalf("%s: own addresses %v %v, rebuilt %v %v", at, p.self.portals, p.self.ports, fresh.portals, fresh.ports)
		}
		for _, l := range p.ports { // newSelfAddrs recorded them again: as they were
			l.selfSP, l.selfPort = l.choose.sp.Load(), 0
			if l.isOpen() {
				l.selfPort = l.proxyPort
			}
		}
	}
	kept := slices.Clone(p.last)
	all := p.portStatesLocked(nil, true)
	if !reflect.DeepEqual(kept, all) {
		var diff []string
		for i := range min(len(kept), len(all)) {
			if !reflect.DeepEqual(kept[i], all[i]) {
				diff = append(diff, fmt.Sprintf("%s: kept %+v, recomputed %+v", all[i].ServicePort.Name, kept[i], all[i]))
			}
		}
		t.Fatalf("%s: port states differ from recomputed ones (%d vs %d):\n%s", at, len(kept), len(all), strings.Join(diff, "\n"))
	}
}

// TestIdlePeriodicSyncAllocations: a periodic sync with nothing changed hands over the last
// sync's port states (the same slice) and allocates nothing per port; so does the first after
// a start (or any change of listeners), which checks every port's endpoints against the
// proxy's own addresses: at 10,000 ports it marked every service dirty (a map of them all) and
// rebuilt every state.
func TestIdlePeriodicSyncAllocations(t *testing.T) {
	const n = 1000
	p := scaleProxierT(t, n)
	p.sync(false) // the first sync after a start: triggered, not periodic
	first := p.Ports()
	p.sync(true) // the first periodic one: every port checked again
	if got := p.Ports(); len(got) != n || &got[0] != &first[0] {
		t.Fatalf("the first periodic sync made a new list of port states (%d), none changed", len(got))
	}
	recheck := testing.AllocsPerRun(5, func() {
		p.recheckGen-- // as after a start: every port checked again
		p.sync(true)
	})
	idle := testing.AllocsPerRun(5, func() { p.sync(true) })
	// What a sync allocates whatever the number of ports: its result, the node's addresses, the
	// changes drained, a log event.
	if recheck > 40 || idle > 40 {
		t.Errorf("periodic syncs of %d unchanged ports: %v allocations (%v checking every port), want a few, none per port", n, idle, recheck)
	}
	if got := p.Ports(); &got[0] != &first[0] {
		t.Errorf("an idle periodic sync made a new list of port states")
	}
}
