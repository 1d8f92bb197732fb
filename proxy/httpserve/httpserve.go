// Package httpserve runs the proxy's small HTTP servers — /healthz and /livez, /metrics and
// /proxyMode, the healthCheckNodePort servers — hardened for ports that anyone who reaches the
// node can connect to. Their clients are probes and scrapers: one short request per connection,
// no request body. So:
//
//   - Every phase of a connection is bounded (Limits): reading the request header, reading the
//     whole request, writing the response, and waiting idle for the next request. A connection
//     that never sends a complete header (slowloris) is closed by the read-header timeout; one
//     kept open after its request, by the idle timeout.
//   - The open connections are capped (ConnLimit), so that a flood of connections cannot exhaust
//     the process's file descriptors (which would stop every service port and /healthz itself).
//     The cap never blocks accepting: a blocked accept would leave the next probe waiting in the
//     kernel's backlog. At the cap, a new connection makes room by closing the connection that has
//     waited longest without a request in progress (it never sent one, or is idle between
//     requests); when every connection has a request in progress, the new one is closed at once.
//     A probe, which sends its request as soon as it connects, is served: its connection is the
//     newest, and those the server has already read from go first, so that a burst of
//     connections accepted faster than their goroutines run does not close it before its
//     request is read.
//
// Close stops a server and waits for all its goroutines, those of its connections included.
package httpserve

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	stdlog "log"
	"net"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
)

// Defaults of Limits.
const (
	// DefaultReadHeaderTimeout bounds the wait for a request header, from the connection's
	// accept (or the first byte of a later request). Probes send theirs right after connecting.
	DefaultReadHeaderTimeout = 5 * time.Second
	// DefaultReadTimeout bounds reading a whole request (the endpoints take no body).
	DefaultReadTimeout = 10 * time.Second
	// DefaultWriteTimeout bounds writing a response; Prometheus's default scrape timeout is 10s.
	DefaultWriteTimeout = 10 * time.Second
	// DefaultIdleTimeout is how long a connection may wait for its next request. Probes make
	// one request per connection; scrapers reconnect at their next scrape.
	DefaultIdleTimeout = 5 * time.Second
	// DefaultMaxHeaderBytes bounds a request header (net/http allows 4 KiB more than this).
	DefaultMaxHeaderBytes = 4 << 10
	// DefaultMaxConns caps a server's open connections. Probes and scrapers need a few at a time;
	// 128 leaves room for many, and bounds what a flood costs (a descriptor, a goroutine and some
	// kilobytes each).
	DefaultMaxConns = 128
)

// warnInterval is the least time between two warnings that a cap was reached.
const warnInterval = time.Minute

// Limits bounds a server's connections; zero fields take the defaults above.
type Limits struct {
	ReadHeaderTimeout time.Duration
	ReadTimeout       time.Duration
	WriteTimeout      time.Duration
	IdleTimeout       time.Duration
	MaxHeaderBytes    int
	// MaxConns caps the open connections, when Options.Conns is nil.
	MaxConns int
}

// WithDefaults returns l with its zero fields set to the defaults.
func (l Limits) WithDefaults() Limits {
	set := func(d *time.Duration, def time.Duration) {
		if *d <= 0 {
			*d = def
		}
	}
	set(&l.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	set(&l.ReadTimeout, DefaultReadTimeout)
	set(&l.WriteTimeout, DefaultWriteTimeout)
	set(&l.IdleTimeout, DefaultIdleTimeout)
	if l.MaxHeaderBytes <= 0 {
		l.MaxHeaderBytes = DefaultMaxHeaderBytes
	}
	if l.MaxConns <= 0 {
		l.MaxConns = DefaultMaxConns
	}
	return l
}

// Options configures a Server.
type Options struct {
	Handler http.Handler
	Limits  Limits
	// Conns, if set, is a cap the server shares with others (Limits.MaxConns is then unused);
	// nil gives the server a cap of its own.
	Conns *ConnLimit
	// Log receives the server's errors, and net/http's messages at debug level; the zero value
	// logs nothing.
	Log zerolog.Logger
}

// Server is one HTTP server on one listener.
type Server struct {
	addr  net.Addr
	log   zerolog.Logger
	http  *http.Server
	conns *ConnLimit

	served chan struct{}  // closed when the accept loop has returned
	active sync.WaitGroup // the connections' goroutines (one per accepted connection)
	ln     net.Listener   // the listener Serve was given
	// draining is set by Shutdown before it closes the listener under the accept loop.
	draining atomic.Bool

	closeOnce sync.Once
	closeErr  error
}

// Serve serves opts.Handler on ln, in goroutines of the Server's own, until Close. The Server
// owns ln.
func Serve(ln net.Listener, opts Options) *Server {
	lim := opts.Limits.WithDefaults()
	conns := opts.Conns
	if conns == nil {
		conns = NewConnLimit(lim.MaxConns, opts.Log)
	}
	s := &Server{addr: ln.Addr(), log: opts.Log, conns: conns, served: make(chan struct{}), ln: ln}
	s.http = &http.Server{
		Handler:           opts.Handler,
		ReadHeaderTimeout: lim.ReadHeaderTimeout,
		ReadTimeout:       lim.ReadTimeout,
		WriteTimeout:      lim.WriteTimeout,
		IdleTimeout:       lim.IdleTimeout,
		MaxHeaderBytes:    lim.MaxHeaderBytes,
		ConnState:         s.connState,
		// Debug: a client can make net/http log (a semicolon in a query does), so a flood of
		// such requests must not flood the log.
		ErrorLog: stdlog.New(debugWriter{opts.Log}, "", 0),
	}
	go func() {
		defer close(s.served)
		err := s.http.Serve(&listener{Listener: ln, s: s})
		if err != nil && !errors.Is(err, http.ErrServerClosed) && !s.draining.Load() {
			s.log.Error().Err(err).Str("address", s.addr.String()).Msg("HTTP server stopped accepting")
		}
	}()
	return s
}

// Addr returns the listener's address.
func (s *Server) Addr() net.Addr { return s.addr }

// Close closes the listener and every connection, and waits for the server's goroutines, the
// handlers included (a handler must return once its connection is closed). Later calls return
// the first's result.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		err := s.http.Close()
		<-s.served
		// A connection accepted while http.Server.Close ran may have escaped it.
		s.conns.closeOwned(s)
		s.active.Wait()
		if err != nil {
			s.closeErr = fmt.Errorf("close the HTTP server on %s: %w", s.addr, err)
		}
	})
	return s.closeErr
}

// Shutdown stops accepting (closing the listener, so a socket shared with another process
// keeps its waiting connections for that process), lets the requests in progress and those of
// the connections already accepted finish (keep-alive ends: each connection closes after its
// answer), then closes like Close. When ctx ends first, the remaining connections are closed at
// once.
//
// It does not use http.Server.Shutdown, which drops a request it reads once shutting down
// (the connection closes unanswered): a connection accepted an instant before would see EOF.
func (s *Server) Shutdown(ctx context.Context) error {
	s.http.SetKeepAlivesEnabled(false) // also closes the idle keep-alive connections
	s.draining.Store(true)
	if err := s.ln.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
		s.log.Debug().Err(err).Msg("closing the listener")
	}
	<-s.served
	drained := make(chan struct{})
	go func() { s.active.Wait(); close(drained) }() // ends at the latest with Close below
	var err error
	select {
	case <-drained:
	case <-ctx.Done():
		err = ctx.Err()
	}
	if cerr := s.Close(); cerr != nil && !errors.Is(cerr, net.ErrClosed) {
		err = errors.Join(err, cerr)
	}
	if err != nil {
		return fmt.Errorf("shut down the HTTP server on %s: %w", s.addr, err)
	}
	return nil
}

// ShutdownAll shuts the servers down at once (see Shutdown) and returns their errors, joined.
func ShutdownAll(ctx context.Context, srvs ...*Server) error {
	errs := make([]error, len(srvs))
	var wg sync.WaitGroup
	for i, srv := range srvs {
		wg.Go(func() { errs[i] = srv.Shutdown(ctx) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (s *Server) connState(c net.Conn, st http.ConnState) {
	s.conns.setState(c, st)
	if st == http.StateClosed || st == http.StateHijacked {
		s.active.Done() // the connection's goroutine is returning
	}
}

// listener admits accepted connections under the server's cap.
type listener struct {
	net.Listener
	s *Server
}

// Accept returns the next connection the cap admits; refused ones are closed here, and the
// loop goes on accepting.
func (l *listener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		tc := &conn{Conn: c}
		if l.s.conns.admit(tc, l.s) {
			// http.Server serves every connection it accepts in a goroutine that ends with
			// StateClosed or StateHijacked (connState).
			l.s.active.Add(1)
			return tc, nil
		}
	}
}

// conn is an accepted connection, which knows whether its server has started reading from it.
type conn struct {
	net.Conn
	reading atomic.Bool
}

func (c *conn) Read(p []byte) (int, error) {
	if !c.reading.Load() {
		c.reading.Store(true)
	}
	return c.Conn.Read(p)
}

// CloseWrite lets net/http half-close the connection before closing it (it does after some
// errors, so that the client reads the answer rather than a reset).
func (c *conn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// abort closes c with a reset: a connection the cap closes leaves no orphaned socket behind
// in the kernel (FIN-WAIT, TIME-WAIT).
func (c *conn) abort() {
	if tc, ok := c.Conn.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}

// ConnLimit caps the open connections of one or more servers. Its methods are safe for
// concurrent use.
type ConnLimit struct {
	max int
	log zerolog.Logger

	mu    sync.Mutex              // guards the following fields
	conns map[net.Conn]*connEntry // by the *conn that http.Server's ConnState reports
	// idle holds the connections without a request in progress, the longest waiting first.
	idle                       list.List
	evicted, refused           uint64 // since the last warning
	totalEvicted, totalRefused uint64
	warned                     bool
	warnedAt                   time.Time
}

// connEntry is one open connection.
type connEntry struct {
	conn  *conn
	owner *Server
	idle  *list.Element // in ConnLimit.idle; nil while a request is in progress
}

// NewConnLimit returns a cap of max open connections (DefaultMaxConns when max ≤ 0). It warns
// on log, at most once a minute, while the cap is reached.
func NewConnLimit(max int, log zerolog.Logger) *ConnLimit {
	if max <= 0 {
		max = DefaultMaxConns
	}
	return &ConnLimit{max: max, log: log, conns: map[net.Conn]*connEntry{}}
}

// Max returns the cap.
func (l *ConnLimit) Max() int { return l.max }

// Stats returns the number of open connections, and how many connections the cap has closed
// so far: idle ones closed to make room, and new ones refused because none was idle.
func (l *ConnLimit) Stats() (open int, evicted, refused uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.conns), l.totalEvicted, l.totalRefused
}

// admitYields is how many times admit lets other goroutines run, at the cap, when no
// connection without a request in progress has been read from: the goroutines of the
// connections just accepted then read their requests (a probe's is there at once), rather than
// the accept loop outrunning them.
const admitYields = 3

// admit registers c, just accepted by owner, as open and waiting for its request. At the cap
// it first closes the connection that has waited longest without a request in progress,
// preferring those the server has read from (a connection just accepted whose request has not
// been read yet may be a probe); when every connection has a request in progress, it closes c
// and reports false.
func (l *ConnLimit) admit(c *conn, owner *Server) bool {
	l.mu.Lock()
	var victim *connEntry
	for yields := 0; len(l.conns) >= l.max; yields++ {
		victim = l.longestIdleLocked(true)
		if victim != nil || yields == admitYields || l.idle.Len() == 0 {
			break
		}
		l.mu.Unlock()
		runtime.Gosched()
		l.mu.Lock()
	}
	if len(l.conns) >= l.max {
		if victim == nil {
			victim = l.longestIdleLocked(false)
		}
		if victim == nil {
			l.refused++
			l.totalRefused++
			l.warnLocked()
			l.mu.Unlock()
			c.abort()
			return false
		}
		l.removeLocked(victim)
		l.evicted++
		l.totalEvicted++
		l.warnLocked()
	} else {
		victim = nil // room was made while yielding
	}
	e := &connEntry{conn: c, owner: owner}
	e.idle = l.idle.PushBack(e)
	l.conns[c] = e
	l.mu.Unlock()
	if victim != nil {
		// Its server's goroutine sees the connection closed and ends it (StateClosed).
		victim.conn.abort()
	}
	return true
}

// longestIdleLocked returns the connection that has waited longest without a request in
// progress (only among those read from, if read), or nil.
func (l *ConnLimit) longestIdleLocked(read bool) *connEntry {
	for el := l.idle.Front(); el != nil; el = el.Next() {
		if e := el.Value.(*connEntry); !read || e.conn.reading.Load() {
			return e
		}
	}
	return nil
}

// setState follows a connection through its states (http.Server.ConnState).
func (l *ConnLimit) setState(c net.Conn, st http.ConnState) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.conns[c]
	if e == nil { // closed by the cap
		return
	}
	switch st {
	case http.StateActive:
		if e.idle != nil {
			l.idle.Remove(e.idle)
			e.idle = nil
		}
	case http.StateIdle:
		if e.idle != nil {
			l.idle.Remove(e.idle)
		}
		e.idle = l.idle.PushBack(e)
	case http.StateClosed, http.StateHijacked:
		l.removeLocked(e)
	}
}

func (l *ConnLimit) removeLocked(e *connEntry) {
	if e.idle != nil {
		l.idle.Remove(e.idle)
		e.idle = nil
	}
	delete(l.conns, e.conn)
}

// closeOwned closes the open connections of owner.
func (l *ConnLimit) closeOwned(owner *Server) {
	l.mu.Lock()
	var owned []*conn
	for _, e := range l.conns {
		if e.owner == owner {
			owned = append(owned, e.conn)
			l.removeLocked(e)
		}
	}
	l.mu.Unlock()
	for _, c := range owned {
		_ = c.Close()
	}
}

// warnLocked logs that the cap is reached, at most once per warnInterval, with what it closed
// since the last warning.
func (l *ConnLimit) warnLocked() {
	now := time.Now()
	if l.warned && now.Sub(l.warnedAt) < warnInterval {
		return
	}
	l.log.Warn().Int("maxConnections", l.max).Uint64("closedIdle", l.evicted).Uint64("refused", l.refused).
		Msg("connection cap reached: closing the connections that wait longest without a request (warning at most once a minute)")
	l.warned, l.warnedAt = true, now
	l.evicted, l.refused = 0, 0
}

// debugWriter writes net/http's log lines to a zerolog logger at debug level.
type debugWriter struct{ log zerolog.Logger }

func (w debugWriter) Write(p []byte) (int, error) {
	n := len(p)
	for n > 0 && p[n-1] == '\n' {
		n--
	}
	w.log.Debug().Msg(string(p[:n]))
	return len(p), nil
}
