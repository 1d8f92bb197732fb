package forward

import (
	"errors"
	"sync/atomic"
)

// Budget is the file-descriptor budget that the data path of every service port shares: the
// sockets of proxied TCP connections (two each), the sockets of UDP sessions (one each) and the
// splice pipes (two descriptors each). The data path takes no new work once the budget is spent,
// so the descriptors above it stay free for the proxy's control work (reading manifests, running
// iptables-restore and conntrack, the API watch, the health server): a flood against the data
// path slows no sync and silences no probe.
//
// The idle splice pipes of every port sharing a budget are pooled in it, so that idle pipes are
// bounded per node rather than per port, and are given up before new work is refused.
//
// A nil *Budget is unlimited. All methods are safe for concurrent use.
type Budget struct {
	limit atomic.Int64
	used  atomic.Int64
	pipes pipePool // idle splice pipes, taken from this budget
}

// NewBudget returns a budget of limit descriptors (see SetLimit).
func NewBudget(limit int) *Budget {
	b := &Budget{}
	b.pipes.budget = b
	b.SetLimit(limit)
	return b
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
// not, it closes the idle pipes and tries once more.
func (b *Budget) Take(n int64) bool {
	if b == nil {
		return true
	}
	for range 2 {
		if b.used.Add(n) <= b.limit.Load() {
			return true
		}
		b.used.Add(-n)
		if b.pipes.dropIdle() == 0 {
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

// Descriptors each piece of the data path holds.
const (
	tcpConnFDs = 2 // the accepted client socket and the socket to the endpoint
	pipeFDs    = 2 // a splice pipe's two ends
)

// errBudgetSpent: the data path's descriptor budget is spent.
var errBudgetSpent = errors.New("descriptor budget of the data path spent")

// errIdle: the connection moved no byte for the idle timeout.
var errIdle = errors.New("idle timeout: no data either way")
