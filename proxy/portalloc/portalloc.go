// Package portalloc parses kube-proxy's --proxy-port-range and hands out proxy ports from it.
//
// The zero Range means "any port": Allocate then returns 0 and the kernel picks a free port when
// the listener is opened. With a range, ports are handed out at random among the free ones, so a
// port released by a deleted service is not immediately reused by the next one.
package portalloc

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
)

// Range is an inclusive port range. The zero value means any port.
type Range struct {
	Base, Size int // ports Base .. Base+Size-1
}

// String returns the range in "begin-end" form ("" for the zero Range).
func (r Range) String() string {
	if r.Size == 0 {
		return ""
	}
	return fmt.Sprintf("%d-%d", r.Base, r.Base+r.Size-1)
}

// Contains reports whether port is in the range.
func (r Range) Contains(port int) bool { return port >= r.Base && port < r.Base+r.Size }

// ParseRange parses kube-proxy's syntax: "begin-end", "begin+offset" (begin..begin+offset), or a
// single port. "" and "0" and "0-0" give the zero Range.
func ParseRange(s string) (Range, error) {
	s = strings.TrimSpace(s)
	if s == "" || s == "0" || s == "0-0" {
		return Range{}, nil
	}
	bad := func(format string, args ...any) (Range, error) {
		return Range{}, fmt.Errorf("invalid port range %q: %s", s, fmt.Sprintf(format, args...))
	}
	parse := func(p string) (int, error) {
		n, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil || n < 1 || n > 65535 {
			return 0, fmt.Errorf("%q is not a port in 1..65535", p)
		}
		return n, nil
	}
	var lo, hi int
	switch {
	case strings.Contains(s, "-"):
		a, b, _ := strings.Cut(s, "-")
		var err error
		if lo, err = parse(a); err != nil {
			return bad("%v", err)
		}
		if hi, err = parse(b); err != nil {
			return bad("%v", err)
		}
	case strings.Contains(s, "+"):
		a, b, _ := strings.Cut(s, "+")
		var err error
		if lo, err = parse(a); err != nil {
			return bad("%v", err)
		}
		off, err := strconv.Atoi(strings.TrimSpace(b))
		if err != nil || off < 0 {
			return bad("offset %q is not a non-negative number", b)
		}
		hi = lo + off
		if hi > 65535 {
			return bad("end %d beyond 65535", hi)
		}
	default:
		var err error
		if lo, err = parse(s); err != nil {
			return bad("%v", err)
		}
		hi = lo
	}
	if hi < lo {
		return bad("end %d before begin %d", hi, lo)
	}
	return Range{Base: lo, Size: hi - lo + 1}, nil
}

// ErrExhausted is returned by Allocate when every port of the range is in use.
var ErrExhausted = errors.New("proxy port range exhausted")

// Allocator hands out ports of a Range. It is safe for concurrent use.
type Allocator struct {
	r Range

	mu   sync.Mutex // guards the following fields
	used map[int]bool
	rand *rand.Rand
}

// NewAllocator returns an Allocator for r. rng may be nil (a random seed is used).
func NewAllocator(r Range, rng *rand.Rand) *Allocator {
	if rng == nil {
		rng = rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	}
	return &Allocator{r: r, used: map[int]bool{}, rand: rng}
}

// Range returns the allocator's range.
func (a *Allocator) Range() Range { return a.r }

// Allocate returns a free port of the range, picked at random, and marks it used. For the zero
// Range it returns 0 (let the kernel choose).
func (a *Allocator) Allocate() (int, error) {
	if a.r.Size == 0 {
		return 0, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	free := a.r.Size - len(a.used)
	if free <= 0 {
		return 0, fmt.Errorf("allocate proxy port from %s: %w", a.r, ErrExhausted)
	}
	// Pick the n-th free port: O(range) worst case, done once per new service port.
	n := a.rand.IntN(free)
	for p := a.r.Base; p < a.r.Base+a.r.Size; p++ {
		if a.used[p] {
			continue
		}
		if n == 0 {
			a.used[p] = true
			return p, nil
		}
		n--
	}
	return 0, fmt.Errorf("allocate proxy port from %s: %w", a.r, ErrExhausted)
}

// Release returns port to the pool. Ports outside the range (0 included) are ignored, so a port
// the kernel chose can be released the same way.
func (a *Allocator) Release(port int) {
	if !a.r.Contains(port) {
		return
	}
	a.mu.Lock()
	delete(a.used, port)
	a.mu.Unlock()
}

// InUse returns how many ports of the range are allocated.
func (a *Allocator) InUse() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.used)
}
