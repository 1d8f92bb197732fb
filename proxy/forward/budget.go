package forward

import (
	"sync"
	"sync/atomic"
)

// Budget is the file-descriptor budget that the data path of every service port shares: the
// sockets of proxied TCP connections (two each), the sockets of UDP sessions (one each) and the
// splice pipes (two descriptors each). The data path takes no new work once the budget is spent,
// so the descriptors above it stay free for the proxy's control work (reading manifests, running
// iptables-restore and conntrack, the API watch, the health server): a flood against the data
// path slows no sync and silences no probe.
//
// Idle descriptors of every port sharing a budget (the TCP engine's splice pipes) are pooled in
// it (Idle), so that they are bounded per node rather than per port, and are given up before new
// work is refused.
//
// A nil *Budget is unlimited. All methods are safe for concurrent use.
type Budget struct {
	limit atomic.Int64
	used  atomic.Int64

	idle   atomic.Pointer[IdleHolder] // set once, by the first Idle
	idleMu sync.Mutex                 // serialises the first Idle calls
}

// IdleHolder holds descriptors of a Budget that no work uses now and that can be closed at once
// (the TCP engine's pool of idle splice pipes): DropIdle closes them, gives them back to the
// budget and returns how many it closed.
type IdleHolder interface {
	DropIdle() int
}

// NewBudget returns a budget of limit descriptors (see SetLimit).
func NewBudget(limit int) *Budget {
	b := &Budget{}
	b.SetLimit(limit)
	return b
}

// Idle returns the budget's IdleHolder, made by newHolder at the first call: every port sharing
// the budget pools its idle descriptors there, and Take drops them before refusing work.
func (b *Budget) Idle(newHolder func() IdleHolder) IdleHolder {
	if h := b.idle.Load(); h != nil {
		return *h
	}
	b.idleMu.Lock()
	defer b.idleMu.Unlock()
	if h := b.idle.Load(); h != nil {
		return *h
	}
	h := newHolder()
	b.idle.Store(&h)
	return h
}

// SetLimit changes how many descriptors the data path may hold. Lowering it below what is in use
// ends nothing: new work is refused until enough has ended.
func (b *Budget) SetLimit(limit int) { b.limit.Store(int64(max(limit, 0))) }

// Limit returns the current limit; 0 for a nil Budget (unlimited).
func (b *Budget) Limit() int {
	if b == nil {
		return 0
	}
	return int(b.limit.Load())
}

// InUse returns the descriptors the data path holds now.
func (b *Budget) InUse() int {
	if b == nil {
		return 0
	}
	return int(b.used.Load())
}

// Take reserves n descriptors and reports whether they were within the limit. When they were
// not, it drops the idle descriptors (see Idle) and tries once more.
func (b *Budget) Take(n int64) bool {
	if b == nil {
		return true
	}
	for range 2 {
		if b.used.Add(n) <= b.limit.Load() {
			return true
		}
		b.used.Add(-n)
		if h := b.idle.Load(); h == nil || (*h).DropIdle() == 0 {
			break
		}
	}
	return false
}

// Force reserves n descriptors even beyond the limit: for work admitted before, such as
// adopted connections, which are counted but never refused.
func (b *Budget) Force(n int64) {
	if b != nil {
		b.used.Add(n)
	}
}

// Give returns n descriptors taken before.
func (b *Budget) Give(n int64) {
	if b != nil {
		b.used.Add(-n)
	}
}
