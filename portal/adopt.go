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
// the listings it read; the first Sync compares our chains in them with what it rendered and,
// when they hold the same rules, writes nothing.

// adoptLocked is the first Sync after PruneStale: when the rules found in our chains (found:
// iptables-save listings per table) are those of tables (see sameRules) and every jump into our
// chains is there, it takes them as written, with the layout of tables (partial updates work by
// portal from here), and returns true.
func (m *Manager) adoptLocked(found map[string][]byte, portals []Portal, host Host, in *syncInput, tables []table, lay *layout, start time.Time) bool {
	if found == nil {
		return false
	}
	written := map[string][]string{}
	for _, t := range tables {
		save, ok := found[t.table]
		if !ok {
			return false
		}
		got, chains := ourRules(t.table, save)
		want := ruleLines(t.payload)
		if chains != len(chainsOf(t.table)) || !sameRules(got, want) {
			return false // a chain missing, or other rules
		}
		written[t.table] = asFound(want, got)
	}
	for _, add := range m.missingJumpsLocked() {
		if len(add) > 0 {
			return false
		}
	}
	m.synced, m.input, m.written, m.layout, m.rewritten = true, in, written, lay, start
	m.deleteStaleFlowsLocked(portals, host.NodeIPs)
	m.log.Info().Int("portals", len(portals)).Dur("took", time.Since(start)).
		Msg("the rules of the earlier run are the ones to write: kept, nothing written")
	return true
}

// ourRules returns the rule lines of our chains of table in an iptables-save listing (substrings
// of one copy of it), and how many of our chains have rules.
func ourRules(table string, save []byte) ([]string, int) {
	ours := chainsOf(table)
	var rules []string
	seen := map[string]bool{}
	for line := range strings.Lines(string(save)) {
		line = strings.TrimSuffix(line, "\n")
		if c, ok := ruleChain(line); ok && slices.Contains(ours, c) {
			rules = append(rules, line)
			seen[c] = true
		}
	}
	return rules, len(seen)
}

// asFound returns want (rendered rules) as they were found in got: a rule found in its chain's
// recent chain under that chain's name, and got's guards in place of want's (in whatever
// grouping they were found). Found lines are copied, so that the listing is not kept.
func asFound(want, got []string) []string {
	recent := map[string]bool{}
	for _, r := range got {
		if unRecent(r) != r {
			recent[unRecent(r)] = true
		}
	}
	out := make([]string, 0, len(want))
	for _, r := range want {
		switch {
		case isGuard(r):
		case recent[r]:
			c, _ := ruleChain(r)
			out = append(out, "-A "+recentChain(c)+r[len("-A "+c):])
		default:
			out = append(out, r)
		}
	}
	for _, r := range got {
		if isGuard(r) {
			out = append(out, strings.Clone(r))
		}
	}
	return out
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
	for i, r := range gotOther {
		gotOther[i] = unRecent(r)
	}
	slices.Sort(gotOther)
	wantOther = slices.Sorted(slices.Values(wantOther))
	if !slices.Equal(gotOther, wantOther) {
		return false
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
	if !strings.HasPrefix(r, "-A ") || !strings.Contains(r[:min(len(r), 40)], "-NEW ") {
		return r
	}
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
		s := out[f] // once per rule: hashing a form hashes its text
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
