package udp

import (
	"net"
	"net/netip"
	"sync"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
)

// The policy of a Proxy's sessions, for both engines (proxy_linux.go, relay.go).

// dialSession picks and opens the endpoint of a new session of client (clientAddr unmapped):
// Choose (reset after the previous endpoint refused the flow), admission (admit: MaxSessions
// and the Budget), the socket (dial); each failure is counted and logged, and ok=false means
// the datagram is dropped. On success the session holds its descriptor of the Budget.
func (p *Proxy) dialSession(clientAddr, dst netip.AddrPort, reset bool, admit func() bool,
	dial func(forward.Target) (*net.UDPConn, error)) (target forward.Target, backend *net.UDPConn, ok bool) {
	target, err := p.Chooser.Choose(clientAddr, dst, reset)
	if err != nil {
		p.logDebug().Err(err).Stringer("client", clientAddr).Stringer("dst", dst).
			Msg("no endpoint; datagram dropped")
		return forward.Target{}, nil, false
	}
	if !admit() {
		p.logDebug().Stringer("client", clientAddr).Msg("no room for a new UDP session; datagram dropped")
		return forward.Target{}, nil, false
	}
	backend, err = dial(target)
	if err != nil {
		p.Budget.Give(udpSessionFDs)
		p.sink().DialFailed(target.Endpoint)
		p.logDebug().Err(err).Stringer("client", clientAddr).Stringer("endpoint", target.Endpoint).
			Msg("cannot open a socket to the endpoint; datagram dropped")
		return forward.Target{}, nil, false
	}
	return target, backend, true
}

// admitSessionWithin takes a new session's descriptor from the Budget within MaxSessions
// (count: the port's sessions now), ending the longest-idle session (evictIdlest) to make room;
// false, logged once at warning level, when there is none to end.
func (p *Proxy) admitSessionWithin(count func() int, evictIdlest func() bool) bool {
	for range 2 {
		full := p.MaxSessions > 0 && count() >= p.MaxSessions
		if !full && p.Budget.Take(udpSessionFDs) {
			return true
		}
		if !evictIdlest() {
			break
		}
	}
	if p.refusedWarned.CompareAndSwap(false, true) {
		p.logWarn().Int("maxSessions", p.MaxSessions).Int("budget", p.Budget.Limit()).Int("budgetInUse", p.Budget.InUse()).
			Msg("UDP datagram dropped: no room for a new session (logged once)")
	}
	return false
}

// evictIdlestOf ends the session of *sessions (guarded by mu) that has been idle longest, the
// one whose lastActive is least, with release and a count of UDPSessionEvicted, and reports
// whether there was one: the eviction of both engines (proxy_linux.go, relay.go). It scans the
// sessions: eviction happens only at a limit, and the limit bounds the scan.
func evictIdlestOf[S any](mu *sync.Mutex, sessions *map[netip.AddrPort]S, lastActive func(S) int64,
	release func(S), metrics forward.Metrics) bool {
	mu.Lock()
	var idlest S
	var client netip.AddrPort
	found := false
	for c, s := range *sessions {
		if !found || lastActive(s) < lastActive(idlest) {
			idlest, client, found = s, c, true
		}
	}
	if found {
		delete(*sessions, client)
	}
	mu.Unlock()
	if !found {
		return false
	}
	release(idlest)
	metrics.UDPSessionEvicted()
	return true
}

// sessionOpened counts and logs a new session.
func (p *Proxy) sessionOpened(clientAddr, dst, endpoint netip.AddrPort, reset bool) {
	p.sink().UDPSessionOpened()
	p.logDebug().Stringer("client", clientAddr).Stringer("dst", dst).Stringer("endpoint", endpoint).
		Bool("reset", reset).Msg("UDP session opened")
}

// flowRefused counts and logs the ICMP error of a session's endpoint (once per session) and
// reports the endpoint to the Chooser (forward.UnreachableChooser), as the TCP proxy reports a
// refused dial: new sessions, and the client's next datagram, which chooses again, pass over it
// for a while.
func (p *Proxy) flowRefused(client, endpoint netip.AddrPort, err error) {
	p.sink().DialFailed(endpoint)
	if uc, ok := p.Chooser.(forward.UnreachableChooser); ok {
		uc.Unreachable(endpoint)
	}
	p.logDebug().Err(err).Stringer("client", client).Stringer("endpoint", endpoint).
		Msg("endpoint refused the flow")
}

// sessionEnded counts and logs the end of a session with its bytes each way.
func (p *Proxy) sessionEnded(client, endpoint netip.AddrPort, toEndpoint, fromEndpoint int64) {
	m := p.sink()
	m.BytesCopied(toEndpoint, fromEndpoint)
	m.UDPSessionClosed()
	p.logDebug().Stringer("client", client).Stringer("endpoint", endpoint).
		Int64("toEndpoint", toEndpoint).Int64("fromEndpoint", fromEndpoint).
		Msg("UDP session closed")
}
