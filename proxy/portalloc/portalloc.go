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
	"os"
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
	// skip are ports of the range never handed out (the kernel's reserved local ports).
	skip map[int]bool
	// aside are ports Allocate hands out only when no other port is free (SetAside).
	aside map[int]bool
}

// NewAllocator returns an Allocator for r. rng may be nil (a random seed is used).
func NewAllocator(r Range, rng *rand.Rand) *Allocator {
	if rng == nil {
		rng = rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	}
	return &Allocator{r: r, used: map[int]bool{}, rand: rng}
}

// NewLocalAllocator returns an Allocator for the zero Range that picks ports itself, from the
// kernel's ephemeral range (net.ipv4.ip_local_port_range of the calling process's network
// namespace) less its reserved ports (ip_local_reserved_ports), as the kernel would for a bind to
// port 0. The kernel's own search for a free port scans the range under a lock, and grows slower
// with every port taken: at 10,000 listeners a bind to port 0 took about 200 µs, a bind to a
// given free port a few µs. If the range cannot be read, it returns NewAllocator(Range{}, rng).
func NewLocalAllocator(rng *rand.Rand) *Allocator {
	r, skip, err := localPortRange("/proc/sys/net/ipv4/")
	if err != nil {
		return NewAllocator(Range{}, rng)
	}
	a := NewAllocator(r, rng)
	a.skip = skip
	return a
}

// localPortRange reads ip_local_port_range and ip_local_reserved_ports under dir; the reserved
// ports are returned as far as they are inside the range.
func localPortRange(dir string) (Range, map[int]bool, error) {
	b, err := os.ReadFile(dir + "ip_local_port_range")
	if err != nil {
		return Range{}, nil, err
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return Range{}, nil, fmt.Errorf("ip_local_port_range: %q", b)
	}
	r, err := ParseRange(f[0] + "-" + f[1])
	if err != nil || r.Size == 0 {
		return Range{}, nil, fmt.Errorf("ip_local_port_range: %q: %v", b, err)
	}
	skip := map[int]bool{}
	if b, err := os.ReadFile(dir + "ip_local_reserved_ports"); err == nil {
		for _, part := range strings.Split(strings.TrimSpace(string(b)), ",") {
			if part == "" {
				continue
			}
			rr, err := ParseRange(part)
			if err != nil {
				continue
			}
			for p := max(rr.Base, r.Base); p < min(rr.Base+rr.Size, r.Base+r.Size); p++ {
				skip[p] = true
			}
		}
	}
	return r, skip, nil
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
	free := a.r.Size - len(a.used) - len(a.skip)
	if free <= 0 {
		return 0, fmt.Errorf("allocate proxy port from %s: %w", a.r, ErrExhausted)
	}
	// A random port, or the first free one after it (wrapping): O(1) expected while the range
	// is not nearly full, instead of a walk of the whole range per port. Ports set aside only
	// when nothing else is free.
	start := a.rand.IntN(a.r.Size)
	for _, avoid := range []bool{true, false} {
		if !avoid && len(a.aside) == 0 {
			break
		}
		for i := range a.r.Size {
			p := a.r.Base + (start+i)%a.r.Size
			if a.used[p] || a.skip[p] || avoid && a.aside[p] {
				continue
			}
			a.used[p] = true
			return p, nil
		}
	}
	return 0, fmt.Errorf("allocate proxy port from %s: %w", a.r, ErrExhausted)
}

// SetAside keeps ports for the owners that will ask for them by number (Reserve): Allocate
// hands them out only when every other port of the range is taken. A restarted proxy sets
// aside the proxy ports the rules of its earlier run name, so that a service port that gets a
// new proxy port does not take another one's old port (nor one that a stale rule still sends
// traffic to) before the first sync. The ports stay set aside for the allocator's life.
func (a *Allocator) SetAside(ports []int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.aside == nil {
		a.aside = map[int]bool{}
	}
	for _, p := range ports {
		if a.r.Contains(p) {
			a.aside[p] = true
		}
	}
}

// Reserve marks port used if it is a free port of the range (set aside or not), not one of the
// kernel's reserved ports, and reports whether it did: a caller that knows which port it wants (the one the
// surviving rules of a restarted proxy name) takes it this way, and falls back to Allocate when
// Reserve says no. For the zero Range every port from 1 to 65535 is "any port": Reserve says yes
// without recording it (the bind finds out whether it is free, and Release ignores it).
func (a *Allocator) Reserve(port int) bool {
	if a.r.Size == 0 {
		return port >= 1 && port <= 65535
	}
	if !a.r.Contains(port) {
		return false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.used[port] || a.skip[port] {
		return false
	}
	a.used[port] = true
	return true
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
