package portal

import (
	"errors"
	"hash/maphash"
	"strings"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
)

// Partial updates by portal.
//
// The Manager remembers what each portal of the last write contributed (layout: a digest of
// the portal and its number of rules in each of our chains, in render's order, ~20 bytes a
// portal); a partial update digests the portals it is given, renders only those whose digest
// it has not written, and deletes the rules of the written portals whose digest is gone. So a
// change of one portal costs its own rules, not a render of every portal and a comparison of
// every rule of both tables (at 10,000 service ports ~23 ms of CPU per partial sync).
// Two portals with the same digest render the same rules (appendPortal encodes every field, and
// the layout is only used with the host it was made with), so the rules it writes are those a
// full render would. It appends them to the recent chains, not to the long chains render
// writes (see recentChain): the rules it remembers as written are in render's order, but a
// portal added since the last full write has its rules in the recent chains.

// numSections is how many per-portal outputs a render has: KUBE-PORTALS-CONTAINER,
// KUBE-PORTALS-HOST, KUBE-NODEPORT-CONTAINER and KUBE-NODEPORT-HOST in nat, then
// KUBE-NODEPORT-NON-LOCAL and KUBE-PORTALS-FILTER in filter (see renderer.sections).
const (
	numSections    = 6
	natSections    = 4 // the first natSections are nat's; the others filter's
	filterSections = numSections - natSections
)

// newline separates the rules of a render.
var newline = []byte{'\n'}

// portalSeed keys the portal digests of this process (they are never stored elsewhere).
var portalSeed = maphash.MakeSeed()

// layout is what each portal contributed to the rules last written, in render's order.
type layout struct {
	host   uint64   // digest of the Host rendered for
	guards uint64   // digest of the guards render makes for the portals' proxy ports
	sums   []uint64 // per portal, its digest (portalSum)
	counts []uint16 // per portal, its number of rules in each section; nil when one did not fit
}

// usable reports whether lay describes a write for host.
func (lay *layout) usable(host Host) bool {
	return lay != nil && lay.counts != nil && len(lay.counts) == len(lay.sums)*numSections && lay.host == hostSum(host)
}

func hostSum(host Host) uint64 { return maphash.Bytes(portalSeed, appendHost(nil, host)) }

// newLayout returns the layout of a render of order for host, its counts still to be filled in
// (see render).
func newLayout(host Host, order []*Portal) *layout {
	lay := &layout{host: hostSum(host), sums: make([]uint64, len(order))}
	var b []byte
	for i, p := range order {
		b = appendPortal(b[:0], p)
		lay.sums[i] = maphash.Bytes(portalSeed, b)
	}
	return lay
}

// renderLocked renders order for host with its layout (see render).
func (m *Manager) renderLocked(host Host, order []*Portal) (tables []table, lay *layout) {
	lay = newLayout(host, order)
	nat, filter := render(m.cfg, host, order, lay)
	return []table{{tableFilter, withCanary(filter, filterChains())}, {tableNAT, withCanary(nat, natChains())}}, lay
}

// portalUpdate is a partial update worked out by portal.
type portalUpdate struct {
	written map[string][]string // the rules once applied, per table, in render's order (guards aside)
	delta   map[string][]byte   // iptables-restore --noflush input per table; absent when nothing changes
	lay     *layout
	fresh   int // portals rendered
}

// planByPortal works out the partial update from the rules written (m.written, m.layout) to
// order's, rendering only the portals not written as they are. ok is false when the layout does
// not describe m.written for host, or the guards are not of our form: the caller renders
// everything then.
func (m *Manager) planByPortal(host Host, order []*Portal) (u portalUpdate, ok bool) {
	was := m.layout
	if !was.usable(host) || m.written == nil {
		return u, false
	}
	natWas, filterWas := m.written[tableNAT], m.written[tableFilter]
	// Where each written portal's rules start, per section, in its table's rules.
	nWas := len(was.sums)
	start := make([]int32, numSections*(nWas+1))
	var pos [numSections]int
	for s := range numSections {
		if s > 0 && s != natSections {
			pos[s] = pos[s-1] + sectionLen(was.counts, s-1)
		}
	}
	for j := range nWas {
		for s := range numSections {
			start[s*(nWas+1)+j] = int32(pos[s])
			pos[s] += int(was.counts[j*numSections+s])
		}
	}
	for s := range numSections {
		start[s*(nWas+1)+nWas] = int32(pos[s])
	}
	natEnd, filterEnd := pos[natSections-1], pos[numSections-1]
	// After the portals' rules: in nat the jumps to the recent chains and the canary jumps; in
	// filter those and the guards (in either order: updateLocked's guardedDiff puts the guards
	// last).
	if natEnd+natSections+len(natChains()) != len(natWas) || filterEnd+filterSections+len(filterChains()) > len(filterWas) {
		return u, false // not the rules the layout was made for
	}
	static, wasGuards := splitGuards(filterWas[filterEnd:])
	if len(static) != filterSections+len(filterChains()) {
		return u, false
	}
	rulesOf := func(j, s int) []string {
		lines := natWas
		if s >= natSections {
			lines = filterWas
		}
		return lines[start[s*(nWas+1)+j]:start[s*(nWas+1)+j+1]]
	}

	byDigest := make(map[uint64]int32, nWas)
	for j, sum := range was.sums {
		if _, dup := byDigest[sum]; !dup {
			byDigest[sum] = int32(j)
		}
	}
	now := newLayout(host, order)
	now.counts = make([]uint16, 0, len(order)*numSections)
	kept := make([]bool, nWas)
	var sections [numSections][]string
	for s := range numSections {
		sections[s] = make([]string, 0, sectionLen(was.counts, s)+4)
	}
	var removed, added [2][]string // nat, filter
	table := func(s int) int { return s / natSections }
	r := newRenderer(m.cfg, host)
	for i, p := range order {
		if j, found := byDigest[now.sums[i]]; found && !kept[j] {
			kept[j] = true
			for s := range numSections {
				rules := rulesOf(int(j), s)
				sections[s] = append(sections[s], rules...)
				now.counts = append(now.counts, uint16(len(rules)))
			}
			continue
		}
		u.fresh++
		for _, sec := range r.sections() {
			*sec = (*sec)[:0]
		}
		r.portal(p)
		for s, sec := range r.sections() {
			rules := ruleLines(*sec)
			if len(rules) > 0xffff {
				return u, false
			}
			inRecent(rules, sectionChains[s])
			sections[s] = append(sections[s], rules...)
			added[table(s)] = append(added[table(s)], rules...)
			now.counts = append(now.counts, uint16(len(rules)))
		}
	}
	for j := range nWas {
		if !kept[j] {
			for s := range numSections {
				removed[table(s)] = append(removed[table(s)], rulesOf(j, s)...)
			}
		}
	}

	// The guards: those of every proxy port now against those written, by the ports they list.
	g := newRenderer(m.cfg, host)
	for _, p := range order {
		g.guard(p)
	}
	rendered := g.guardRules(nil)
	now.guards = maphash.Bytes(portalSeed, rendered)
	guards, delta := wasGuards, []byte(nil)
	if now.guards != was.guards { // the proxy ports changed
		if delta, guards, ok = guardDelta(wasGuards, ruleLines(rendered)); !ok {
			return u, false
		}
	}

	var nat, filter []string
	for s := range natSections {
		nat = append(nat, sections[s]...)
	}
	nat = append(nat, natWas[natEnd:]...) // the canary jumps
	for s := natSections; s < numSections; s++ {
		filter = append(filter, sections[s]...)
	}
	filter = append(append(filter, guards...), static...)
	u = portalUpdate{written: map[string][]string{tableNAT: nat, tableFilter: filter}, delta: map[string][]byte{},
		lay: now, fresh: u.fresh}
	if d := diffRules(removed[0], added[0]); len(d) > 0 {
		u.delta[tableNAT] = d
	}
	if d := append(diffRules(removed[1], added[1]), delta...); len(d) > 0 {
		u.delta[tableFilter] = d
	}
	return u, true
}

// inRecent moves rules ("-A chain ...") to chain's recent chain.
func inRecent(rules []string, chain string) {
	prefix := "-A " + chain + " "
	for i, r := range rules {
		if strings.HasPrefix(r, prefix) {
			rules[i] = "-A " + recentChain(chain) + " " + r[len(prefix):]
		}
	}
}

// sectionLen returns how many rules section s has in all (counts as in layout).
func sectionLen(counts []uint16, s int) int {
	n := 0
	for i := s; i < len(counts); i += numSections {
		n += int(counts[i])
	}
	return n
}

// updateByPortalLocked is Update's partial write worked out by portal (see planByPortal). It
// returns false, having written nothing, when that cannot be done; a failed write falls back to
// rewriting everything, as updateLocked's does.
func (m *Manager) updateByPortalLocked(portals []Portal, order []*Portal, host Host, in *syncInput, start time.Time) (bool, error) {
	u, ok := m.planByPortal(host, order)
	if !ok {
		return false, nil
	}
	planned := time.Now()
	var deltaBytes int
	var writes []iptables.TablePayload
	for _, t := range []string{tableFilter, tableNAT} { // filter first: see Sync
		if delta := u.delta[t]; len(delta) > 0 {
			writes = append(writes, iptables.TablePayload{Table: t, Payload: delta})
			deltaBytes += len(delta)
		}
	}
	if len(writes) > 0 {
		m.rewritten = time.Time{} // the next Sync rewrites, in render's order
		restoreStart := time.Now()
		err := m.restoreTablesLocked(writes)
		m.log.Debug().Int("tables", len(writes)).Int("deltaBytes", deltaBytes).Dur("took", time.Since(restoreStart)).Msg("wrote changed portal rules")
		if err != nil {
			m.log.Warn().Err(err).Msg("writing the changed portal rules failed; rewriting all of them")
			m.synced = false
			tables, lay := m.renderLocked(host, order)
			return true, errors.Join(m.rewriteLocked(portals, host, in, tables, lay, start)...)
		}
	}
	m.written, m.layout, m.input = u.written, u.lay, in
	m.deleteStaleFlowsLocked(portals, host.NodeIPs)
	m.log.Debug().Int("portals", len(portals)).Int("rendered", u.fresh).Int("deltaBytes", deltaBytes).
		Dur("plan", planned.Sub(start)).Dur("restore", time.Since(planned)).Dur("total", time.Since(start)).Msg("updated portal rules")
	return true, nil
}

// tablesRestorer writes several tables in one iptables-restore (*iptables.Runner does).
type tablesRestorer interface {
	RestoreTables(tables ...iptables.TablePayload) error
}

// restoreTablesLocked writes the tables, in order, in one iptables-restore when the Runner can
// (one process start and one read of the kernel's state instead of one per table), otherwise one
// each.
func (m *Manager) restoreTablesLocked(writes []iptables.TablePayload) error {
	if tr, ok := m.run.(tablesRestorer); ok && len(writes) > 1 {
		return tr.RestoreTables(writes...)
	}
	for _, w := range writes {
		if err := m.run.Restore(w.Table, w.Payload); err != nil {
			return err
		}
	}
	return nil
}

// isGuard reports whether rule is one of KUBE-PORTALS-PROXY-PORTS's guards (see splitGuards).
func isGuard(rule string) bool {
	return strings.HasPrefix(rule, "-A "+ChainProxyPorts+" ") && strings.Contains(rule, " --dports ")
}
