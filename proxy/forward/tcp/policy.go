package tcp

import (
	"errors"
	"net"
	"net/netip"
	"slices"
	"syscall"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
)

// The connection policy of a Proxy, one for every engine (the event loops of loop_linux.go,
// the portable relay of relay.go): admission, the choice of an endpoint, the failover from
// one dial attempt to the next with its timeouts and log lines, and the PROXY protocol header.
// An engine does the I/O and calls these at each step; none of these rules is written twice.

// errNoEndpointReached: every dial attempt of a connection failed.
var errNoEndpointReached = errors.New("no endpoint could be reached")

// admitLocked reports whether a new connection fits within MaxConns (live connections of the
// port are open) and the Budget, and if so takes its descriptors from the Budget. The engine's
// lock guarding live must be held.
func (p *Proxy) admitLocked(live int) bool {
	return (p.MaxConns <= 0 || live < p.MaxConns) && p.Budget.Take(tcpConnFDs)
}

// refused counts and logs a connection refused at admission; the engine resets it.
func (p *Proxy) refused() {
	p.sink().ConnRefused() // counted before the client can see the reset
	p.warnRefused()
}

// wantsOriginalDst reports whether the Chooser looks at a connection's original destination
// (see OriginalDstChooser).
func (p *Proxy) wantsOriginalDst() bool {
	oc, ok := p.Chooser.(forward.OriginalDstChooser)
	return !ok || oc.NeedsOriginalDst()
}

// dialPlan is where a connection is in its dial attempts. An attempt that timed out spends its
// timeout: the next one gets the next of dialTimeouts(), and the plan ends when they are spent.
// An attempt the endpoint (or the network on its way) answered at once, with a refusal or an
// unreachable error, spends no time and no timeout: the next endpoint is tried with the same
// one, up to maxDialAttempts attempts in all, but never to an endpoint that already refused the
// connection: when Choose offers one again, every endpoint it has to offer has failed. So when
// many endpoints die at once (a scale-down whose pods stop before their EndpointSlices say so),
// a connection tries one after the other within its client's patience instead of giving up
// after a few refusals. Every attempt after a failed one asks Choose with reset=true.
type dialPlan struct {
	attempt  uint8 // attempts made
	timedOut uint8 // attempts that timed out
	reset    bool  // the next Choose is a retry
	// answered are the endpoints that refused (or had no route for) this connection; nil until
	// one does.
	answered []netip.AddrPort
}

// maxDialAttempts bounds the attempts of one connection, refused ones included.
const maxDialAttempts = 16

// next returns the timeout of the next attempt, or false when the plan is spent.
func (d *dialPlan) next(p *Proxy) (time.Duration, bool) {
	ts := p.dialTimeouts()
	if int(d.timedOut) >= len(ts) || d.attempt >= maxDialAttempts {
		return 0, false
	}
	return ts[d.timedOut], true
}

// choose asks the Chooser for the endpoint of the next attempt; on an error (logged) the engine
// resets the client.
func (p *Proxy) choose(d *dialPlan, client, dst netip.AddrPort) (forward.Target, error) {
	target, err := p.Chooser.Choose(client, dst, d.reset)
	if err != nil {
		p.logDebug().Err(err).Stringer("client", client).Stringer("dst", dst).
			Msg("no endpoint; resetting the client")
		return target, err
	}
	if slices.Contains(d.answered, target.Endpoint) {
		return target, p.unreachable(d, client, dst)
	}
	return target, nil
}

// attemptFailed records a failed dial attempt to endpoint (metrics, log), tells the Chooser
// when the endpoint is to blame (forward.UnreachableChooser), and moves d on to the next attempt.
func (p *Proxy) attemptFailed(d *dialPlan, client, endpoint netip.AddrPort, err error) {
	p.sink().DialFailed(endpoint)
	kind := dialFailureOf(err)
	if kind != dialFailedOther {
		if uc, ok := p.Chooser.(forward.UnreachableChooser); ok {
			uc.Unreachable(endpoint)
		}
	}
	if kind == dialAnswered {
		d.answered = append(d.answered, endpoint)
	} else {
		d.timedOut++
	}
	d.reset = true
	d.attempt++
	if e := p.logDebug(); e.Enabled() {
		timeout, _ := d.next(p)
		e.Err(err).Stringer("client", client).Stringer("endpoint", endpoint).
			Int("attempt", int(d.attempt)).Dur("nextTimeout", timeout).Msg("dial endpoint failed")
	}
}

// How a dial attempt failed.
const (
	dialAnswered    = iota // refused or unreachable, at once: it spent no time
	dialTimedOut           // no answer within its timeout
	dialFailedOther        // anything else (the proxy's side: an address, a socket option)
)

// dialFailureOf tells how a dial attempt failed from its error.
func dialFailureOf(err error) int {
	var ne net.Error
	switch {
	case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.EHOSTUNREACH),
		errors.Is(err, syscall.ENETUNREACH), errors.Is(err, syscall.ECONNRESET):
		return dialAnswered
	case errors.Is(err, syscall.ETIMEDOUT), errors.As(err, &ne) && ne.Timeout():
		return dialTimedOut
	}
	return dialFailedOther
}

// socketFailed logs a dial that could not even create its socket for want of descriptors or
// memory: the engine closes the client rather than trying the next endpoint.
func (p *Proxy) socketFailed(client, endpoint netip.AddrPort, err error) {
	p.sink().DialFailed(endpoint)
	p.logWarn().Err(err).Stringer("client", client).Stringer("endpoint", endpoint).
		Msg("cannot create a socket to the endpoint; closing the client")
}

// unreachable logs that every attempt failed and returns the error the client is reset with.
func (p *Proxy) unreachable(d *dialPlan, client, dst netip.AddrPort) error {
	p.logWarn().Stringer("client", client).Stringer("dst", dst).Int("attempts", int(d.attempt)).
		Msg("no endpoint could be reached; resetting the client")
	return errNoEndpointReached
}

// proxyHeader returns the PROXY protocol header of version v for a connection from client whose
// original destination is dst (local, the address it reached the proxy at, when dst is
// unknown); on an error (logged) the engine resets the client.
func (p *Proxy) proxyHeader(v proxyproto.Version, client, endpoint, dst, local netip.AddrPort) ([]byte, error) {
	if !dst.IsValid() {
		dst = local
	}
	hdr, err := proxyproto.AppendHeader(make([]byte, 0, 64), v, true, client, dst)
	if err != nil {
		p.logDebug().Err(err).Stringer("client", client).Stringer("endpoint", endpoint).
			Msg("sending the PROXY protocol header failed; resetting the client")
	}
	return hdr, err
}

// connEnded records the end of an admitted connection: for one that reached endpoint, its bytes
// each way and a debug line; for one that never did, ConnFailed.
func (p *Proxy) connEnded(connected bool, client, endpoint netip.AddrPort, toEndpoint, fromEndpoint int64, err error) {
	if !connected {
		p.sink().ConnFailed()
		return
	}
	p.sink().BytesCopied(toEndpoint, fromEndpoint)
	p.sink().ConnClosed()
	if e := p.logDebug(); e.Enabled() {
		e.Stringer("client", client).Stringer("endpoint", endpoint).
			Int64("toEndpoint", toEndpoint).Int64("fromEndpoint", fromEndpoint).AnErr("err", err).
			Msg("connection closed")
	}
}
