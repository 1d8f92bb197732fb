package forwardtest

import (
	"errors"
	"net/netip"
	"sync"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
)

// ChooseCall is one recorded Chooser.Choose call.
type ChooseCall struct {
	Client, Dst netip.AddrPort
	Reset       bool
}

// Chooser is a forward.Chooser that returns its Endpoints in turn (round robin), or Err, and
// records every call.
type Chooser struct {
	mu        sync.Mutex
	Endpoints []netip.AddrPort
	Err       error
	next      int
	calls     []ChooseCall
	failed    []netip.AddrPort // Unreachable's reports
	// Returned in every forward.Target.
	Transparent   bool
	ProxyProtocol proxyproto.Version
}

var _ forward.UnreachableChooser = (*Chooser)(nil)

// Unreachable records the report.
func (c *Chooser) Unreachable(endpoint netip.AddrPort) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.failed = append(c.failed, endpoint)
}

// Unreachables returns the endpoints reported by Unreachable so far.
func (c *Chooser) Unreachables() []netip.AddrPort {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]netip.AddrPort(nil), c.failed...)
}

// Choose returns the next endpoint, or Err.
func (c *Chooser) Choose(client, dst netip.AddrPort, reset bool) (forward.Target, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls = append(c.calls, ChooseCall{Client: client, Dst: dst, Reset: reset})
	if c.Err != nil {
		return forward.Target{}, c.Err
	}
	if len(c.Endpoints) == 0 {
		return forward.Target{}, errors.New("no endpoints")
	}
	ep := c.Endpoints[c.next%len(c.Endpoints)]
	c.next++
	return forward.Target{Endpoint: ep, Transparent: c.Transparent, ProxyProtocol: c.ProxyProtocol}, nil
}

// Set replaces the endpoints and starts the round robin again.
func (c *Chooser) Set(endpoints ...netip.AddrPort) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.Endpoints, c.next = endpoints, 0
}

// Recorded returns the calls so far.
func (c *Chooser) Recorded() []ChooseCall {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]ChooseCall(nil), c.calls...)
}

// Resets returns the reset argument of each call so far.
func (c *Chooser) Resets() []bool {
	var out []bool
	for _, call := range c.Recorded() {
		out = append(out, call.Reset)
	}
	return out
}
