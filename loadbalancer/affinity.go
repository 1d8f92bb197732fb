package loadbalancer

import (
	"math"
	"net/netip"
	"slices"
	"time"
)

// DefaultMaxAffinityEntries is the number of ClientIP affinity entries a service port keeps
// when Options.MaxAffinityEntries is not set.
//
// The bound is per service port, so that a flood of (spoofed) clients on one service evicts
// only that service's clients, and ports keep sharing no lock. A full table of 10,000 entries
// takes about 1.6 MiB, up to about 3.6 MiB after millions of evictions (Go maps keep some
// deleted slots), so even a hundred flooded affinity services stay within a few hundred MiB.
// It is generous next to kube-proxy's iptables mode, whose affinity lives in the kernel's
// xt_recent lists: 100 clients per endpoint by default (the module's ip_list_tot), the oldest
// forgotten first, so 10,000 per service only for a service of 100 endpoints. A node's proxy
// sees as ClusterIP clients only its own pods; many more clients come only through NodePorts,
// external IPs and load-balancer IPs.
const DefaultMaxAffinityEntries = 10_000

// affinityEntry is the endpoint last chosen for one client under one selection rule, linked
// into its table's use order.
type affinityEntry struct {
	client netip.Addr // unmapped
	pool   uint8      // poolCluster or poolLocal
	ep     netip.AddrPort
	// used is when the entry was last used, as the time since RoundRobin.epoch.
	used time.Duration
	// newer and older are the entries used just after and just before this one: indices into
	// affinityTable.entries, -1 at either end.
	newer, older int32
}

// affinityTable holds one service port's affinity entries, at most max of them: per selection
// rule a map from client to entry (keyed by netip.Addr, which hashes and compares faster than
// a combined key), and a doubly linked list of the entries from the most to the least recently
// used.
// The list is intrusive and its nodes are the elements of one dense slice, linked by index, so
// that looking up, using, adding, evicting and removing an entry are O(1), and using one
// allocates nothing. Entries are used (and added) at the time now() gives under the port's
// lock, so unless that clock goes backwards the list's order is the order of their used times,
// the oldest last: the expired entries are the list's tail.
type affinityTable struct {
	index   [numPools]map[netip.Addr]int32 // nil until the rule has an entry
	entries []affinityEntry                // dense: removing an entry moves the last one into its place
	// newest and oldest are the list's ends (-1 when empty).
	newest, oldest int32
	max            int
}

// newAffinityTable returns an empty table of at most limit entries (at least 1).
func newAffinityTable(limit int) *affinityTable {
	return &affinityTable{newest: -1, oldest: -1, max: min(max(limit, 1), math.MaxInt32)}
}

// get returns the index of the entry of client (unmapped) under pool.
func (t *affinityTable) get(pool int, client netip.Addr) (int32, bool) {
	i, ok := t.index[pool][client]
	return i, ok
}

// use records that entry i was used at now, with endpoint ep, making it the newest.
func (t *affinityTable) use(i int32, ep netip.AddrPort, now time.Duration) {
	e := &t.entries[i]
	e.ep, e.used = ep, now
	if t.newest == i {
		return
	}
	t.unlink(i)
	t.pushNewest(i)
}

// add adds an entry for client (unmapped) under pool, which must not have one, as the newest.
// At the bound it evicts the least recently used entry for it first, and reports so.
func (t *affinityTable) add(pool int, client netip.Addr, ep netip.AddrPort, now time.Duration) (evicted bool) {
	var i int32
	if len(t.entries) >= t.max {
		i = t.oldest // reuse its slot
		old := &t.entries[i]
		delete(t.index[old.pool], old.client)
		t.unlink(i)
		evicted = true
	} else {
		n := len(t.entries)
		if n == cap(t.entries) { // grow by doubling, but never past the bound
			t.entries = slices.Grow(t.entries, min(max(n, 8), t.max-n))
		}
		i = int32(n)
		t.entries = t.entries[:n+1]
	}
	t.entries[i] = affinityEntry{client: client, pool: uint8(pool), ep: ep, used: now}
	if t.index[pool] == nil {
		t.index[pool] = map[netip.Addr]int32{}
	}
	t.index[pool][client] = i
	t.pushNewest(i)
	return evicted
}

// remove removes entry i, moving the last entry into its slot.
func (t *affinityTable) remove(i int32) {
	delete(t.index[t.entries[i].pool], t.entries[i].client)
	t.unlink(i)
	last := int32(len(t.entries) - 1)
	if i != last {
		e := t.entries[last]
		t.entries[i] = e
		t.index[e.pool][e.client] = i
		if e.newer >= 0 {
			t.entries[e.newer].older = i
		} else {
			t.newest = i
		}
		if e.older >= 0 {
			t.entries[e.older].newer = i
		} else {
			t.oldest = i
		}
	}
	t.entries[last] = affinityEntry{} // drop its address's reference
	t.entries = t.entries[:last]
}

// expire removes the entries last used at or before cutoff.
func (t *affinityTable) expire(cutoff time.Duration) {
	for t.oldest >= 0 && t.entries[t.oldest].used <= cutoff {
		t.remove(t.oldest)
	}
}

// removeFunc removes the entries for which drop returns true.
func (t *affinityTable) removeFunc(drop func(*affinityEntry) bool) {
	// Backwards: remove moves the last entry, already kept, into the hole.
	for i := int32(len(t.entries) - 1); i >= 0; i-- {
		if drop(&t.entries[i]) {
			t.remove(i)
		}
	}
}

// compact returns t, or a copy in smaller storage when t holds a quarter or less of what its
// slice can (Go maps never shrink, so the map is rebuilt too); nil when t is empty.
func (t *affinityTable) compact() *affinityTable {
	switch n := len(t.entries); {
	case n == 0:
		return nil
	case cap(t.entries) < 64 || n > cap(t.entries)/4:
		return t
	}
	c := &affinityTable{
		entries: append(make([]affinityEntry, 0, 2*len(t.entries)), t.entries...), // same indices
		newest:  t.newest,
		oldest:  t.oldest,
		max:     t.max,
	}
	for pool, m := range t.index {
		if len(m) > 0 {
			c.index[pool] = make(map[netip.Addr]int32, len(m))
		}
	}
	for i, e := range c.entries {
		c.index[e.pool][e.client] = int32(i)
	}
	return c
}

// unlink takes entry i out of the list.
func (t *affinityTable) unlink(i int32) {
	e := &t.entries[i]
	if e.newer >= 0 {
		t.entries[e.newer].older = e.older
	} else {
		t.newest = e.older
	}
	if e.older >= 0 {
		t.entries[e.older].newer = e.newer
	} else {
		t.oldest = e.newer
	}
	e.newer, e.older = -1, -1
}

// pushNewest puts entry i, not in the list, at its newest end.
func (t *affinityTable) pushNewest(i int32) {
	e := &t.entries[i]
	e.newer, e.older = -1, t.newest
	if t.newest >= 0 {
		t.entries[t.newest].newer = i
	} else {
		t.oldest = i
	}
	t.newest = i
}
