package portal

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
)

// DefaultRewritePeriod is how long a Manager goes at most without rewriting every rule of ours
// (Options.RewritePeriod), as kube-proxy's iptables mode does once an hour.
const DefaultRewritePeriod = time.Hour

// chainCanary is the canary chain, one per table: an empty chain that each of our chains of
// the table jumps to in its last rule. The jumps do nothing (the canary returns at once), but
// the chain's reference count, which one cheap listing tells, drops when someone flushes or
// deletes one of our chains, and the chain is gone when someone flushes the whole table.
const chainCanary = "KUBE-PORTALS-CANARY"

// withCanary returns payload (Render's output for a table whose chains are chains) with the
// canary chain declared first and a jump to it appended to each of chains.
func withCanary(payload []byte, chains []string) []byte {
	decl := ":" + chainCanary + " - [0:0]\n"
	b := make([]byte, 0, len(decl)+len(payload)+len(chains)*(len(chainCanary)+40))
	b = append(append(b, decl...), payload...)
	for _, c := range chains {
		b = append(b, canaryRule(c)...)
		b = append(b, '\n')
	}
	return b
}

// canaryRule is the last rule of our chain c, as iptables-save prints it.
func canaryRule(c string) string { return "-A " + c + " -j " + chainCanary }

// chainsOf returns our chains of table, without the canary.
func chainsOf(table string) []string {
	if table == tableNAT {
		return natChains()
	}
	return filterChains()
}

// rewriteDueLocked reports whether a full Sync must rewrite every rule whatever it finds: no
// full write succeeded yet, one failed or a partial write came since, or the last is
// Options.RewritePeriod old.
func (m *Manager) rewriteDueLocked() bool {
	return !m.synced || m.written == nil || m.rewritten.IsZero() || time.Since(m.rewritten) >= m.rewriteEvery
}

// sameRulesLocked reports whether tables hold the very rules last written.
func (m *Manager) sameRulesLocked(tables []table) bool {
	if m.written == nil {
		return false
	}
	for _, t := range tables {
		if !slices.Equal(m.written[t.table], ruleLines(t.payload)) {
			return false
		}
	}
	return true
}

// syncInput is what Render was given, as a digest: comparing it costs far less than rendering,
// and it holds 32 bytes where a copy of the portals held ~170 bytes per portal (1.7 MB at
// 10,000). Every field of every portal and of the host is in it (TestSyncInputSeesEveryField).
type syncInput struct {
	sum [sha256.Size]byte
}

// newSyncInput returns the digest of portals and host. Every sync makes one: its hash and
// buffer come from inputHashers, so that it allocates only the result.
func newSyncInput(portals []Portal, host Host) *syncInput {
	ih := inputHashers.Get().(*inputHasher)
	defer inputHashers.Put(ih)
	h := ih.h
	h.Reset()
	b := appendHost(ih.buf[:0], host)
	b = binary.AppendVarint(b, int64(len(portals)))
	for i := range portals {
		b = appendPortal(b, &portals[i])
		if len(b) > inputChunk {
			h.Write(b)
			b = b[:0]
		}
	}
	h.Write(b)
	ih.buf = b[:0]
	in := &syncInput{}
	h.Sum(in.sum[:0])
	return in
}

// inputChunk is how much of newSyncInput's encoding is hashed at a time.
const inputChunk = 32 << 10

// inputHasher is newSyncInput's hash and buffer (growing from one chunk to the largest
// encoding of a portal past it, at most), reused through inputHashers.
type inputHasher struct {
	h   hash.Hash
	buf []byte
}

var inputHashers = sync.Pool{New: func() any {
	return &inputHasher{h: sha256.New(), buf: make([]byte, 0, inputChunk+1024)}
}}

// appendHost appends an encoding of every field of host to b.
func appendHost(b []byte, host Host) []byte {
	return appendAddrs(b, host.NodeIPs)
}

// appendPortal appends an encoding of every field of p to b: two portals with the same encoding
// render the same rules.
func appendPortal(b []byte, p *Portal) []byte {
	b = appendString(b, p.Comment)
	b = appendString(b, p.Protocol)
	b = binary.AppendVarint(b, int64(p.Port))
	b = appendAddr(b, p.ClusterIP)
	b = appendAddrs(b, p.ExternalIPs)
	b = appendAddrs(b, p.LoadBalancerIPs)
	b = binary.AppendVarint(b, int64(len(p.LoadBalancerSourceRanges)))
	for _, r := range p.LoadBalancerSourceRanges {
		b = appendAddr(b, r.Addr())
		b = binary.AppendVarint(b, int64(r.Bits()))
	}
	b = binary.AppendVarint(b, int64(p.NodePort))
	b = binary.AppendVarint(b, int64(p.ProxyPort))
	b = binary.AppendVarint(b, int64(p.Internal))
	return binary.AppendVarint(b, int64(p.External))
}

func appendString(b []byte, s string) []byte {
	return append(binary.AppendVarint(b, int64(len(s))), s...)
}

func appendAddr(b []byte, a netip.Addr) []byte {
	b = binary.AppendVarint(b, int64(a.BitLen())) // 0, 32 or 128
	switch {
	case a.Is4():
		v := a.As4()
		return append(b, v[:]...)
	case a.Is6():
		v := a.As16()
		return appendString(append(b, v[:]...), a.Zone())
	}
	return b
}

func appendAddrs(b []byte, as []netip.Addr) []byte {
	b = binary.AppendVarint(b, int64(len(as)))
	for _, a := range as {
		b = appendAddr(b, a)
	}
	return b
}

// same reports whether in and o are digests of the same input; a nil one is of none.
func (in *syncInput) same(o *syncInput) bool {
	return in != nil && o != nil && in.sum == o.sum
}

// intactLocked reports whether our rules are as the last write left them, and if not, why.
// With iptables-nft it checks that every jump into our chains is in place (one listing per
// built-in chain) and that the canary chain of each table still has one reference per chain of
// ours (one listing of an empty chain): a flushed or deleted chain, or table, shows. A single
// rule deleted inside a chain does not; the periodic rewrite (Options.RewritePeriod) repairs
// that. With iptables-legacy every listing reads a whole table, so it reads each table once
// (iptables-save) and compares the rules of each of our chains with what it wrote (in any
// order: see sameInAnyOrder), and the jumps.
func (m *Manager) intactLocked() (bool, string) {
	if m.run.Mode() == iptables.ModeLegacy {
		return m.intactBySaveLocked()
	}
	return m.intactByCanaryLocked()
}

func (m *Manager) intactByCanaryLocked() (bool, string) {
	present := m.listJumpsLocked()
	for _, j := range jumps() {
		if !present[jumpKey(j.table, j.from, j.spec)] {
			return false, fmt.Sprintf("jump %s/%s -> %s missing", j.table, j.from, j.to)
		}
	}
	for _, table := range []string{tableFilter, tableNAT} {
		n, err := m.run.References(table, chainCanary)
		if err != nil {
			return false, err.Error()
		}
		if want := len(chainsOf(table)); n != want {
			return false, fmt.Sprintf("%s: %d of our %d chains end in the jump to %s (a chain flushed or deleted)", table, n, want, chainCanary)
		}
	}
	return true, ""
}

func (m *Manager) intactBySaveLocked() (bool, string) {
	for _, table := range []string{tableFilter, tableNAT} {
		save, err := m.run.Save(table)
		if err != nil {
			return false, err.Error()
		}
		rules, present, err := parseSave(table, save)
		if err != nil {
			return false, err.Error()
		}
		for _, j := range jumps() {
			if j.table == table && !present[jumpKey(j.table, j.from, j.spec)] {
				return false, fmt.Sprintf("jump %s/%s -> %s missing", j.table, j.from, j.to)
			}
		}
		if !maps.EqualFunc(rules, byChain(m.written[table]), sameInAnyOrder) {
			return false, table + ": the rules in our chains differ from those written"
		}
	}
	return true, ""
}

// parseSave returns, from an iptables-save listing of table, the rule lines of each of our
// chains in order, and the jumps from built-in chains (keyed by jumpKey).
func parseSave(table string, save []byte) (map[string][]string, map[string]bool, error) {
	rules := map[string][]string{}
	present := map[string]bool{}
	ours := chainsOf(table)
	hooks := hookChains(table)
	sc := bufio.NewScanner(bytes.NewReader(save))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		chain, ok := ruleChain(line)
		switch {
		case !ok:
		case slices.Contains(ours, chain):
			rules[chain] = append(rules[chain], line)
		case slices.Contains(hooks, chain):
			args, err := iptables.SplitRule(line)
			if err != nil {
				return nil, nil, fmt.Errorf("%s: %w", table, err)
			}
			present[jumpKey(table, chain, args[2:])] = true
		}
	}
	if err := sc.Err(); err != nil {
		return nil, nil, fmt.Errorf("%s: read iptables-save: %w", table, err)
	}
	return rules, present, nil
}

// ruleChain returns the chain of an "-A chain ..." line.
func ruleChain(line string) (string, bool) {
	rest, ok := strings.CutPrefix(line, "-A ")
	if !ok {
		return "", false
	}
	chain, _, ok := strings.Cut(rest, " ")
	return chain, ok
}

// sameInAnyOrder reports whether a and b hold the same rules, in whatever order; it sorts both.
// The order within one of our chains is not compared: rules of different portals never match
// the same packets, and a partial write puts its rules where the bookkeeping does not (an
// appended guard after its chain's canary jump, a recent chain's rules in the order they came).
func sameInAnyOrder(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// byChain groups rule lines by chain, keeping their order.
func byChain(lines []string) map[string][]string {
	out := map[string][]string{}
	for _, l := range lines {
		if c, ok := ruleChain(l); ok {
			out[c] = append(out[c], l)
		}
	}
	return out
}

// jumpKey identifies a rule of a built-in chain by its arguments.
func jumpKey(table, from string, spec []string) string {
	return table + "/" + from + " " + strings.Join(spec, "\x00")
}
