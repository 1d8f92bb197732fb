package tcp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/logscope"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/runstate"
	"github.com/rs/zerolog"
)

// defaultDialTimeouts are kube-proxy's: four attempts, 3.75 s in all.
func defaultDialTimeouts() []time.Duration {
	return []time.Duration{250 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second}
}

// sharedDialTimeouts is defaultDialTimeouts for every proxy without DialTimeouts: read only.
var sharedDialTimeouts = defaultDialTimeouts()

// Proxy forwards every connection accepted on Listener to an endpoint picked by Chooser, on
// the event loops Loops (see loop_linux.go).
//
// Set the fields, then run Serve in a goroutine (or Start); the fields must not change after
// that. Close stops accepting; established connections go on until they end or Shutdown cuts
// them.
//
// A slow or dead endpoint never holds up accepting: dials are non-blocking connects the loop
// times. A connection's endpoint is dialled with DialTimeouts[0]; when that fails, Choose is
// asked again with reset=true, with the next timeout after a dial that timed out and the same
// one after a refusal (see dialPlan), until the list is exhausted; a Chooser that is a
// forward.UnreachableChooser hears of each failed dial. A
// client whose connection cannot reach any endpoint is reset (RST), so it learns at once that
// the service is unavailable instead of mistaking a FIN for an empty answer. Once connected, the
// proxy copies bytes both ways (splicing bulk traffic), passes a half-close (EOF) from either
// side on as a shutdown(SHUT_WR) to the other (the second one as the close of both), and resets
// both sides if either fails.
//
// Both sockets have TCP_NODELAY. The endpoint side has TCP keepalive; the client side has it
// when the Listener came from Listen (see keepalive_linux.go).
type Proxy struct {
	// Listener is the service port's listening socket. Required. The proxy owns it from Serve
	// on: Close and Shutdown close it.
	Listener *net.TCPListener
	// Chooser picks the endpoint of each connection. Required.
	Chooser forward.Chooser
	// Loops are the event loops that serve the listener and relay the connections. Required;
	// they must outlive the proxy.
	Loops *Loops
	// Log receives the proxy's events; nil discards them. Scope it to the service port.
	// Per-connection events are at debug level. (A pointer: a Logger is 112 bytes, held by
	// every service port's proxy.)
	Log *zerolog.Logger
	// LogScope, if set, adds the fields naming the service port to each event, at log time
	// (see LogScope); Log then need not be scoped.
	LogScope forward.LogScope
	// DialTimeouts are the timeouts of the successive dial attempts of one connection. nil or
	// empty means 250ms, 500ms, 1s, 2s, as kube-proxy had it.
	DialTimeouts []time.Duration
	// Metrics receives traffic events; nil means none.
	Metrics forward.Metrics
	// Budget is the descriptor budget shared with the other service ports; nil means
	// unlimited. A connection that would exceed it is reset at once (Metrics.ConnRefused).
	Budget *forward.Budget
	// MaxConns bounds the connections of this service port open at once (accepted and not yet
	// ended); 0 means no bound but the Budget's. A connection above it is reset at once.
	MaxConns int
	// IdleTimeout ends (resets both sides of) a connection that has moved no byte either way
	// for that long, as iptables mode's conntrack established timeout would; 0 means never.
	IdleTimeout time.Duration

	// testHookAcceptPause, if set, is called before each pause of accepting.
	testHookAcceptPause func(attempt int, delay time.Duration)
	// testHookLoopStarting, if set, is called by a Serve on Loops once it has started, before it
	// takes the listener's descriptor.
	testHookLoopStarting func()

	connWG sync.WaitGroup // one count per connection not yet ended (or frozen)

	pipes pipePool // splice pipes of the connections, idle ones only, when there is no Budget

	transparentWarned atomic.Bool // a failed transparent dial was logged at warning level
	refusedWarned     atomic.Bool // a refused connection was logged at warning level

	run runstate.State

	relay *tcpRelay // the portable engine's state, where it serves (relay_other.go; tests)

	mu       sync.Mutex // guards the following fields
	freezing bool       // Freeze has marked every connection: Adopt admits no more
	onLoop   *loopProxy // the proxy's state on its loops, from its first use
}

// errNoLoops: a Proxy was started without Loops.
var errNoLoops = errors.New("the fields Listener, Chooser and Loops are required")

// Serve has the Loops accept and relay connections until Close, Shutdown or Freeze. It
// returns nil after Close, or an error if accept fails for a reason other than running out of
// file descriptors or memory (which pauses accepting instead). It may be called once.
func (p *Proxy) Serve() error {
	if p.Listener == nil || p.Chooser == nil || p.Loops == nil {
		return fmt.Errorf("serve TCP proxy: %w", errNoLoops)
	}
	return p.serveOnLoop()
}

// Start serves like Serve but returns at once: the loops accept and relay, and an accept error
// that stops the listener is logged by them.
func (p *Proxy) Start() error {
	if p.Listener == nil || p.Chooser == nil || p.Loops == nil {
		return fmt.Errorf("start TCP proxy: %w", errNoLoops)
	}
	_, err := p.startOnLoop()
	return err
}

// The configuration the fields give, resolved where it is used (the fields do not change once
// the proxy serves): nothing derived from them is kept, as every listener has a Proxy.

// sink returns Metrics, or a Metrics that discards everything.
func (p *Proxy) sink() forward.Metrics {
	if p.Metrics == nil {
		return forward.NopMetrics{}
	}
	return p.Metrics
}

// dialTimeouts returns DialTimeouts, or the default ones.
func (p *Proxy) dialTimeouts() []time.Duration {
	if len(p.DialTimeouts) == 0 {
		return sharedDialTimeouts
	}
	return p.DialTimeouts
}

// pipePool returns the pool of splice pipes the connections use: the Budget's (shared by every
// port), or the proxy's own.
func (p *Proxy) pipePool() *pipePool {
	if p.Budget != nil {
		b := p.Budget
		return b.Idle(func() forward.IdleHolder { return &pipePool{budget: b} }).(*pipePool)
	}
	return &p.pipes
}

// Close stops accepting: it closes the Listener and returns once the accept loop is gone.
// Established connections, and connections still dialling, go on. Close may be called more
// than once, and before Serve. On a frozen proxy it is Release.
func (p *Proxy) Close() error {
	if _, frozen := p.run.Status(); frozen {
		p.Release()
		return nil
	}
	var sock io.Closer
	if p.Listener != nil {
		sock = p.Listener
		if p.Loops != nil {
			sock = loopListenerCloser{p} // off the loops first
		}
	}
	first, err := p.run.Close(sock, "TCP proxy listener")
	if first {
		p.pipes.closeAll() // connections still running close their pipes when done
	}
	return err
}

// Shutdown closes the proxy like Close, then waits for its connections to end. When ctx ends
// first, it cuts the remaining connections (resetting both sides), waits for them to end and
// returns ctx's error. On a frozen proxy it is Release: the frozen connections belong to
// whoever adopts them, and are not cut.
func (p *Proxy) Shutdown(ctx context.Context) error {
	if _, frozen := p.run.Status(); frozen {
		p.Release()
		return nil
	}
	return p.drain(ctx, p.Close(), p.cutLoopConns)
}

// drain is Shutdown once the proxy no longer accepts (closeErr is what closing it returned): it
// waits for the connections to end, and when ctx ends first it cuts them with cut (the engine's:
// the loops' or, off Linux, the relay's), waits for them and returns ctx's error.
func (p *Proxy) drain(ctx context.Context, closeErr error, cut func() int) error {
	drained := make(chan struct{})
	go p.awaitConns(drained)
	select {
	case <-drained:
		return closeErr
	case <-ctx.Done():
	}
	n := cut()
	<-drained // cut connections end promptly: their sockets are closed and dials cancelled
	return errors.Join(closeErr, fmt.Errorf("shut down TCP proxy: cut %d connections: %w", n, ctx.Err()))
}

// awaitConns closes drained once every connection has ended. Its owner is
// Shutdown, which no longer admits new connections and cuts the remaining ones if it must.
func (p *Proxy) awaitConns(drained chan<- struct{}) {
	p.connWG.Wait()
	close(drained)
}

// isPendingConnError reports whether an accept error belongs to the one pending connection that
// failed (accept(2): "Linux accept() passes already-pending network errors on the new socket as
// an error code"; EPERM: a firewall rule refused it), so the loop should simply accept again.
func isPendingConnError(err error) bool {
	for _, e := range []syscall.Errno{syscall.ECONNABORTED, syscall.EPROTO, syscall.ENETDOWN,
		syscall.ENOPROTOOPT, syscall.EHOSTDOWN, syscall.EHOSTUNREACH,
		syscall.EOPNOTSUPP, syscall.ENETUNREACH, syscall.EPERM} {
		if errors.Is(err, e) {
			return true
		}
	}
	for _, e := range osPendingConnErrnos {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// warnRefused logs the first connection refused at admission at warning level.
func (p *Proxy) warnRefused() {
	if p.refusedWarned.CompareAndSwap(false, true) {
		p.logWarn().Int("maxConns", p.MaxConns).Int("budget", p.Budget.Limit()).Int("budgetInUse", p.Budget.InUse()).
			Msg("connection refused: this port's connection limit or the data path's descriptor budget is reached (logged once)")
	}
}

// testHookCloseWriteSkipped, if set, is called when a connection leaves its first EOF's
// shutdown(SHUT_WR) to the close of both sockets that the second EOF brings. A package variable,
// not a field: it costs the proxies nothing; tests that set it do so before their proxy starts
// and clear it after it ends.
var testHookCloseWriteSkipped func()

// logDebug, logInfo, logWarn and logError start an event of Log at their level, with LogScope's
// fields.
func (p *Proxy) logDebug() *zerolog.Event {
	return logscope.Event(p.LogScope, logscope.Logger(p.Log).Debug())
}
func (p *Proxy) logInfo() *zerolog.Event {
	return logscope.Event(p.LogScope, logscope.Logger(p.Log).Info())
}
func (p *Proxy) logWarn() *zerolog.Event {
	return logscope.Event(p.LogScope, logscope.Logger(p.Log).Warn())
}
func (p *Proxy) logError() *zerolog.Event {
	return logscope.Event(p.LogScope, logscope.Logger(p.Log).Error())
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
