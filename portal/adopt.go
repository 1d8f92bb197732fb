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
// when they hold the same rules, writes nothing. When some differ — a service changed while no
// proxy ran, or a proxy port of the earlier run was taken meanwhile (at 10,000 service ports a
// third of the ephemeral range is proxy ports, and the proxy's own connections to the API
// server, made before its listeners open, land on one of them about as often), so that its
// portal gets another — it keeps the portals found whole and writes the difference, as a partial
// update does: at 10,000 service ports ~30 ms instead of ~0.5 s.

// adoptLocked is the first Sync after PruneStale (found: its iptables-save listings per table).
// With every jump into our chains in place and every chain there, it takes what it finds:
// when our chains hold the rules of tables (see sameRules), as written, with the layout of
// tables (partial updates work by portal from here), writing nothing; otherwise, as written
// by portal (see foundLayout), and writes the difference as a partial update does — the
// portals changed while no proxy ran, and any whose proxy port could not be had again (another
// socket took it meanwhile), rather than every rule. It returns false, having written nothing,
// when the caller must write every rule.
func (m *Manager) adoptLocked(found map[string][]byte, portals []Portal, order []*Portal, host Host, in *syncInput, tables []table, lay *layout, start time.Time) (bool, error) {
	if found == nil {
		return false, nil
	}
	for table, add := range m.missingJumpsLocked() {
		if len(add) > 0 {
			m.log.Debug().Str("table", table).Str("missing", string(add)).Msg("the earlier run's jumps are not all there; writing every rule")
			return false, nil
		}
	}
	got := map[string][]string{}
	same := true
	for _, t := range tables {
		save, ok := found[t.table]
		if !ok {
			m.log.Debug().Str("table", t.table).Msg("the earlier run's rules: table not read; writing every rule")
			return false, nil
		}
		rules, chains := ourRules(t.table, save)
		if chains != len(chainsOf(t.table)) {
			m.log.Debug().Str("table", t.table).Int("chains", chains).Msg("the earlier run's chains are not all there; writing every rule")
			return false, nil
		}
		got[t.table] = rules
		if same && !sameRules(rules, ruleLines(t.payload)) {
			same = false
			if e := m.log.Debug(); e.Enabled() {
				only, extra := ruleDifference(rules, ruleLines(t.payload))
				e.Str("table", t.table).Str("firstFoundOnly", only).Str("firstRenderedOnly", extra).
					Msg("the earlier run's rules differ from this run's")
			}
		}
	}
	if same {
		written := map[string][]string{}
		for _, t := range tables {
			written[t.table] = asFound(ruleLines(t.payload), got[t.table])
		}
		m.synced, m.input, m.written, m.layout, m.rewritten = true, in, written, lay, start
		m.deleteStaleFlowsLocked(portals, host.NodeIPs)
		m.log.Info().Int("portals", len(portals)).Dur("took", time.Since(start)).
			Msg("the rules of the earlier run are the ones to write: kept, nothing written")
		return true, nil
	}
	written, was, kept, ok := foundLayout(got, tables, lay)
	if !ok {
		m.log.Debug().Msg("the earlier run's rules cannot be told apart by portal; writing every rule")
		return false, nil
	}
	m.synced, m.written, m.layout, m.rewritten = true, written, was, start
	done, err := m.updateByPortalLocked(portals, order, host, in, start)
	if !done {
		m.synced, m.written, m.layout, m.rewritten = false, nil, nil, time.Time{}
		return false, nil
	}
	if err == nil {
		// Writing the difference cleared m.rewritten (updateByPortalLocked), as a partial
		// update does so that the next full Sync puts the rules it appended to the recent
		// chains back in render's order: ~0.45 s of rewriting at 10,000 service ports, right
		// after a restart. This was a full Sync: it checked every jump and chain and compared
		// every rule of ours with the render, and the few rules it appended are no different
		// from those found in the recent chains, which the branch above keeps until the
		// periodic rewrite.
		m.rewritten = start
	}
	m.log.Info().Int("portals", len(lay.sums)).Int("kept", kept).Dur("took", time.Since(start)).
		Msg("the rules of the earlier run kept where they are this run's; wrote the difference")
	return true, err
}

// foundLayout describes the rules found in our chains (got, per table, as iptables-save lists
// them) as a write that planByPortal can start from: the rendered portals (tables, lay) whose
// rules are all there — in their chains or their chains' recent chains — each as itself, and
// one more entry, which no portal matches, holding every other rule found (so that
// planByPortal deletes them and renders the portals not found whole). It also returns how many
// portals were found; ok is false when a found rule belongs to no section, or the jumps to the
// recent chains and the canary jumps are not there as rendered.
func foundLayout(got map[string][]string, tables []table, lay *layout) (written map[string][]string, was *layout, kept int, ok bool) {
	if lay == nil || lay.counts == nil || len(lay.counts) != len(lay.sums)*numSections {
		return nil, nil, 0, false
	}
	// The found rules, by their text in the chain of portal rules they belong to.
	pool := map[string][]string{}
	var guards []string
	for _, rules := range got {
		for _, r := range rules {
			if isGuard(r) {
				guards = append(guards, strings.Clone(r))
				continue
			}
			k := unRecent(r)
			pool[k] = append(pool[k], r)
		}
	}
	take := func(r string) (string, bool) {
		list := pool[r]
		if len(list) == 0 {
			return "", false
		}
		f := list[len(list)-1]
		pool[r] = list[:len(list)-1]
		if f == r {
			return r, true // the rendered line: the listing is not kept
		}
		return strings.Clone(f), true
	}
	// The rendered rules of each section, then the static ones of each table (the jumps to the
	// recent chains, the canaries), which must be there.
	var sections [numSections][]string
	static := map[string][]string{}
	for _, t := range tables {
		want := ruleLines(t.payload)
		from, to := 0, natSections
		if t.table == tableFilter {
			from, to = natSections, numSections
		}
		for s := from; s < to; s++ {
			n := sectionLen(lay.counts, s)
			if n > len(want) {
				return nil, nil, 0, false
			}
			sections[s], want = want[:n], want[n:]
		}
		for _, r := range want {
			if isGuard(r) {
				continue
			}
			if _, found := take(r); !found {
				return nil, nil, 0, false
			}
			static[t.table] = append(static[t.table], r)
		}
	}
	// Each portal whose every rule is there, as found.
	n := len(lay.sums)
	was = &layout{host: lay.host, sums: make([]uint64, 0, n+1), counts: make([]uint16, 0, (n+1)*numSections)}
	var out [numSections][]string
	var off [numSections]int
	var mine []string
	for j := range n {
		mine = mine[:0]
		whole := true
		for s := range numSections {
			for _, r := range sections[s][off[s] : off[s]+int(lay.counts[j*numSections+s])] {
				f, found := take(r)
				if !found {
					whole = false
					break
				}
				mine = append(mine, f)
			}
			if !whole {
				break
			}
		}
		if whole {
			kept++
			was.sums = append(was.sums, lay.sums[j])
			i := 0
			for s := range numSections {
				c := int(lay.counts[j*numSections+s])
				out[s] = append(out[s], mine[i:i+c]...)
				was.counts = append(was.counts, uint16(c))
				i += c
			}
		} else {
			for _, f := range mine { // back to the pool, for the entry of the rest
				k := unRecent(f)
				pool[k] = append(pool[k], f)
			}
		}
		for s := range numSections {
			off[s] += int(lay.counts[j*numSections+s])
		}
	}
	// Every other rule found: one entry, by section.
	var rest [numSections][]string
	for _, k := range slices.Sorted(maps.Keys(pool)) {
		for _, f := range pool[k] {
			c, _ := ruleChain(k)
			s := slices.Index(sectionChains[:], c)
			if s < 0 {
				return nil, nil, 0, false
			}
			rest[s] = append(rest[s], strings.Clone(f))
		}
	}
	taken := make(map[uint64]bool, n)
	for _, sum := range lay.sums {
		taken[sum] = true
	}
	var restSum uint64
	for taken[restSum] {
		restSum++
	}
	was.sums = append(was.sums, restSum)
	for s := range numSections {
		if len(rest[s]) > 0xffff {
			return nil, nil, 0, false
		}
		out[s] = append(out[s], rest[s]...)
		was.counts = append(was.counts, uint16(len(rest[s])))
	}
	var nat, filter []string
	for s := range natSections {
		nat = append(nat, out[s]...)
	}
	for s := natSections; s < numSections; s++ {
		filter = append(filter, out[s]...)
	}
	nat = append(nat, static[tableNAT]...)
	filter = append(append(filter, static[tableFilter]...), guards...)
	return map[string][]string{tableNAT: nat, tableFilter: filter}, was, kept, true
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

// ruleDifference returns, for a debug log, the first rule (in sorted order) found only in got
// and the first only in want, recent chains folded into their chains ("" when none).
func ruleDifference(got, want []string) (gotOnly, wantOnly string) {
	count := map[string]int{}
	for _, r := range got {
		count[unRecent(r)]++
	}
	for _, r := range want {
		count[unRecent(r)]--
	}
	for _, r := range slices.Sorted(maps.Keys(count)) {
		switch n := count[r]; {
		case n > 0 && gotOnly == "":
			gotOnly = r
		case n < 0 && wantOnly == "":
			wantOnly = r
		}
	}
	return gotOnly, wantOnly
}
