package portal

import (
	"maps"
	"slices"
	"strings"
	"time"
)

// A restarted proxy's first Sync.
//
// The rules an earlier run left stay in place until the first Sync replaces them (PruneStale
// leaves our chains alone, and the proxy ports they name are reused: Set.SurvivingProxyPorts).
// When the services have not changed meanwhile, that Sync would write the very rules that are
// there: at 10,000 service ports ~0.55 s of iptables-nft-restore for nothing. PruneStale keeps
// what it read of our chains; the first Sync compares it with what it rendered and, when they
// hold the same rules, writes nothing.

// adoptLocked is the first Sync after PruneStale: when the rules found in our chains are those
// of tables (see sameRules) and every jump into our chains is there, it takes them as written
// and returns true. When they are Render's, in its order, it carries on as after a full write
// (partial updates work by portal from here); when they differ only in order, grouping of the
// guards, or in a partial update's rules sitting in a recent chain, the next periodic Sync
// rewrites them.
func (m *Manager) adoptLocked(found map[string]map[string][]string, portals []Portal, host Host, in *syncInput, tables []table, lay *layout, start time.Time) bool {
	if found == nil {
		return false
	}
	exact := true
	written := map[string][]string{}
	for _, t := range tables {
		want := ruleLines(t.payload)
		have := found[t.table]
		var got []string
		for _, c := range chainsOf(t.table) {
			got = append(got, have[c]...)
		}
		if len(have) != len(chainsOf(t.table)) || !sameRules(got, want) {
			return false // a chain missing, or other rules
		}
		exact = exact && maps.EqualFunc(have, byChain(want), slices.Equal)
		written[t.table] = got
	}
	for _, add := range m.missingJumpsLocked() {
		if len(add) > 0 {
			return false
		}
	}
	m.synced, m.input = true, in
	if exact {
		m.written, m.layout, m.rewritten = written, lay, start
		// written holds the found rules, which are Render's: the layout describes them.
		for _, t := range tables {
			m.written[t.table] = ruleLines(t.payload)
		}
	} else {
		m.written, m.layout, m.rewritten = written, nil, time.Time{}
	}
	m.deleteStaleFlowsLocked(portals, host.NodeIPs)
	m.log.Info().Int("portals", len(portals)).Bool("inRenderOrder", exact).Dur("took", time.Since(start)).
		Msg("the rules of the earlier run are the ones to write: kept, nothing written")
	return true
}

// sameRules reports whether the rules of our chains got (as found) do what want (as rendered)
// does: the same rules in each chain, in any order (rules of different portals never match the
// same packets), a portal's rules in its chain's recent chain counting as the chain's, and the
// guards of KUBE-PORTALS-PROXY-PORTS guarding the same ports however grouped.
func sameRules(got, want []string) bool {
	gotOther, gotGuards := splitGuards(got)
	wantOther, wantGuards := splitGuards(want)
	if len(gotOther) != len(wantOther) {
		return false
	}
	count := make(map[string]int, len(wantOther))
	for _, r := range wantOther {
		count[r]++
	}
	for _, r := range gotOther {
		r = unRecent(r)
		if count[r] == 0 {
			return false
		}
		count[r]--
	}
	g, ok := guardedPorts(gotGuards)
	if !ok {
		return false
	}
	w, ok := guardedPorts(wantGuards)
	return ok && maps.EqualFunc(g, w, func(a, b *portSet) bool { return *a == *b })
}

// unRecent returns a rule of a recent chain as a rule of its chain; other rules, the canary
// jump of a recent chain among them, as they are.
func unRecent(r string) string {
	for _, c := range sectionChains {
		rc := "-A " + recentChain(c) + " "
		if strings.HasPrefix(r, rc) && r != canaryRule(recentChain(c)) {
			return "-A " + c + " " + r[len(rc):]
		}
	}
	return r
}

// guardedPorts returns the ports guards guard, per form.
func guardedPorts(guards []string) (map[guardForm]*portSet, bool) {
	out := map[guardForm]*portSet{}
	for _, r := range guards {
		f, ports, ok := parseGuard(r)
		if !ok {
			return nil, false
		}
		s := out[f]
		if s == nil {
			s = new(portSet)
			out[f] = s
		}
		for _, p := range ports {
			s.add(p)
		}
	}
	return out, true
}
