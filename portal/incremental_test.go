//go:build linux

package portal

import (
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

// TestPlanByPortalMatchesRender changes random portals (fuzzInput's) over many partial updates
// and checks each update worked out by portal against a full Render: the rules it remembers are
// Render's, in its order (the guards by the ports they list; a recent chain's rules as its
// chain's), its iptables-restore input turns the rules written before into those, appending to
// recent chains only, and it rendered only the portals whose encoding it had not written. (fuzzInput repeats a portal at times, when it runs out of bytes: so do proxiers
// with bugs.)
func TestPlanByPortalMatchesRender(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	random := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		b[0] = 0 // IPv4
		return b
	}
	cfg, host, _ := fuzzInput(random(64))
	portals := func() []Portal {
		_, _, ps := fuzzInput(random(2000))
		return ps
	}
	m := &Manager{cfg: cfg}
	var ps []Portal
	for range 20 {
		ps = append(ps, portals()...)
	}
	tables, lay := m.renderLocked(host, renderOrder(ps))
	m.written = map[string][]string{tableFilter: ruleLines(tables[0].payload), tableNAT: ruleLines(tables[1].payload)}
	m.layout = lay
	for round := range 200 {
		written := map[string]bool{}
		for _, p := range renderOrder(ps) {
			written[string(appendPortal(nil, p))] = true
		}
		// Remove some, change some, add some.
		for range rng.IntN(3) {
			if len(ps) > 0 {
				i := rng.IntN(len(ps))
				ps = slices.Delete(ps, i, i+1)
			}
		}
		for range rng.IntN(3) {
			if len(ps) == 0 {
				break
			}
			p := &ps[rng.IntN(len(ps))]
			switch rng.IntN(4) {
			case 0:
				p.ProxyPort = 1 + rng.IntN(65535)
			case 1:
				p.Internal, p.External = p.External, p.Internal
			case 2:
				p.ExternalIPs = append(slices.Clip(p.ExternalIPs), netip.AddrFrom4([4]byte{192, 0, 2, byte(rng.Uint32())}))
			case 3:
				p.NodePort = 30000 + rng.IntN(2768)
			}
		}
		if rng.IntN(2) == 0 {
			ps = append(ps, portals()...)
		}
		order := renderOrder(ps)
		u, ok := m.planByPortal(host, order)
		if !ok {
			t.Fatalf("round %d: no plan by portal", round)
		}
		fresh := 0 // a portal written twice (only with equal portals) is kept once
		for _, p := range order {
			if k := string(appendPortal(nil, p)); written[k] {
				delete(written, k)
			} else {
				fresh++
			}
		}
		if u.fresh != fresh {
			t.Errorf("round %d: rendered %d portals, %d are not written as they are", round, u.fresh, fresh)
		}
		want, _ := m.renderLocked(host, order)
		wantFilter, wantNAT := ruleLines(want[0].payload), ruleLines(want[1].payload)
		if got, want := foldRecent(u.written[tableNAT]), foldRecent(wantNAT); !slices.Equal(got, want) {
			t.Fatalf("round %d: nat rules remembered:\n%s\nwant:\n%s", round, lines(got), lines(want))
		}
		checkSameRules(t, "remembered filter", foldRecent(u.written[tableFilter]), foldRecent(wantFilter), true)
		checkSameRules(t, "nat after the delta", foldRecent(applyDelta(t, m.written[tableNAT], u.delta[tableNAT])), foldRecent(wantNAT), false)
		checkSameRules(t, "filter after the delta", foldRecent(applyDelta(t, m.written[tableFilter], u.delta[tableFilter])), foldRecent(wantFilter), false)
		// What it appends goes to the recent chains (or is a guard).
		for _, d := range u.delta {
			for l := range strings.Lines(string(d)) {
				if strings.HasPrefix(l, "-A ") && !isGuard(l) && !slices.ContainsFunc(sectionChains[:], func(c string) bool {
					return strings.HasPrefix(l, "-A "+recentChain(c)+" ")
				}) {
					t.Errorf("round %d: appends to a long chain: %s", round, l)
				}
			}
		}
		if t.Failed() {
			t.Fatalf("round %d failed", round)
		}
		m.written, m.layout = u.written, u.lay
	}

	// A layout is for the host it was made with.
	host.NodeIPs = append(slices.Clone(host.NodeIPs), a("192.0.2.250"))
	if _, ok := m.planByPortal(host, renderOrder(ps)); ok {
		t.Error("planned by portal for another host")
	}
}

// checkSameRules compares rules with want: the guards by the ports they list, the others as a
// multiset, or in order when ordered.
func checkSameRules(t *testing.T, what string, got, want []string, ordered bool) {
	t.Helper()
	gotOther, gotGuards := splitGuards(got)
	wantOther, wantGuards := splitGuards(want)
	if !ordered {
		gotOther, wantOther = slices.Sorted(slices.Values(gotOther)), slices.Sorted(slices.Values(wantOther))
	}
	if !slices.Equal(gotOther, wantOther) {
		t.Errorf("%s:\n%s\nwant:\n%s", what, strings.Join(gotOther, "\n"), strings.Join(wantOther, "\n"))
	}
	if g, w := guardPorts(t, gotGuards), guardPorts(t, wantGuards); !maps.EqualFunc(g, w, slices.Equal) {
		t.Errorf("%s: guards cover %v, want %v", what, g, w)
	}
}
