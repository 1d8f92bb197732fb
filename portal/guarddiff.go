package portal

import (
	"maps"
	"math/bits"
	"slices"
	"strconv"
	"strings"
)

// The guards of a partial update.
//
// Deleting a rule is what costs in a partial update: iptables-nft reads every rule of the
// chain to find it (at 10,000 service ports, ~0.3 s for the nat chains, and tens of ms for
// KUBE-PORTALS-PROXY-PORTS), while appending one costs the kernel's commit only. render lists the
// proxy ports of a block of port numbers in one rule, so one more service port would replace its
// block's rule (a deletion) when a rule of its own does the same. guardedDiff therefore changes
// the guards by the ports they list: a new proxy port is guarded by a rule appended for it (the
// new ports of one protocol and destination share rules, up to multiport's 15); a rule is
// deleted only when a port it lists is no longer a proxy port, and its other ports are listed
// anew. Until the next full Sync rewrites them in render's form, the guards then differ from
// render's in how they group the ports, not in which ports they guard.

// guardedDiff is diffRules for the filter table, with the rules of KUBE-PORTALS-PROXY-PORTS
// changed by their ports (see above). It returns the iptables-restore input and the rules as they
// are once it is applied.
func guardedDiff(was, now []string) ([]byte, []string) {
	wasOther, wasGuards := splitGuards(was)
	nowOther, nowGuards := splitGuards(now)
	delta, guards, ok := guardDelta(wasGuards, nowGuards)
	if !ok { // a guard not of our form: line by line
		return diffRules(was, now), now
	}
	return append(diffRules(wasOther, nowOther), delta...), append(nowOther, guards...)
}

// splitGuards returns the rules of rules that are not guards, and those that are (the chain's
// canary jump is not).
func splitGuards(rules []string) (other, guards []string) {
	for _, r := range rules {
		if isGuard(r) {
			guards = append(guards, r)
		} else {
			other = append(other, r)
		}
	}
	return other, guards
}

// guardForm is a guard rule without its port list: the text before and after it.
type guardForm struct{ before, after string }

func (f guardForm) rule(ports []int) string {
	var b strings.Builder
	b.WriteString(f.before)
	for i, p := range ports {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(p))
	}
	b.WriteString(f.after)
	return b.String()
}

// parseGuard splits a guard rule into its form and its ports.
func parseGuard(rule string) (guardForm, []int, bool) {
	const opt = " --dports "
	i := strings.Index(rule, opt)
	if i < 0 {
		return guardForm{}, nil, false
	}
	rest := rule[i+len(opt):]
	end := strings.IndexByte(rest, ' ')
	if end < 0 {
		end = len(rest)
	}
	list, after := rest[:end], rest[end:] // after keeps its leading space: no copy
	ports := make([]int, 0, strings.Count(list, ",")+1)
	for f := range strings.SplitSeq(list, ",") {
		p, err := strconv.Atoi(f)
		if err != nil || p <= 0 || p > 65535 {
			return guardForm{}, nil, false
		}
		ports = append(ports, p)
	}
	return guardForm{before: rule[:i+len(opt)], after: after}, ports, true
}

// portSet is a set of port numbers (1–65535), as bits: a few forms (protocols) hold up to
// every proxy port each, and a partial sync at 10,000 ports spent more in int maps than in the
// rest of this.
type portSet [1024]uint64

func (s *portSet) add(p int)      { s[p>>6] |= 1 << (p & 63) }
func (s *portSet) has(p int) bool { return s[p>>6]&(1<<(p&63)) != 0 }

// guardDelta returns the input that turns the guards was into guards of the ports of now, by
// ports (see guardedDiff), and the guards after it; ok is false when a rule does not parse.
func guardDelta(was, now []string) (delta []byte, guards []string, ok bool) {
	want, ok := guardedPorts(now)
	if !ok {
		return nil, nil, false
	}
	have := map[guardForm]*portSet{}
	for _, r := range was {
		f, ports, ok := parseGuard(r)
		if !ok {
			return nil, nil, false
		}
		w := want[f]
		if w == nil || slices.ContainsFunc(ports, func(p int) bool { return !w.has(p) }) {
			delta = append(append(append(delta, "-D "...), r[len("-A "):]...), '\n')
			continue
		}
		guards = append(guards, r)
		h := have[f]
		if h == nil {
			h = new(portSet)
			have[f] = h
		}
		for _, p := range ports {
			h.add(p)
		}
	}
	forms := slices.SortedFunc(maps.Keys(want), func(a, b guardForm) int {
		return strings.Compare(a.before+a.after, b.before+b.after)
	})
	for _, f := range forms {
		w, h := want[f], have[f]
		if h == nil {
			h = new(portSet)
		}
		var add []int
		for i, word := range w {
			for word &^= h[i]; word != 0; word &= word - 1 {
				add = append(add, i<<6+bits.TrailingZeros64(word))
			}
		}
		for len(add) > 0 {
			n := min(len(add), guardBucket)
			r := f.rule(add[:n])
			delta = append(append(delta, r...), '\n')
			guards = append(guards, r)
			add = add[n:]
		}
	}
	return delta, guards, true
}
