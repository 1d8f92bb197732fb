package httpserve

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/httpserve/httpservetest"
)

var ok = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") })

// start serves h on a loopback port; the test's cleanup closes the server.
func start(t *testing.T, h http.Handler, opts Options) (*Server, string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	opts.Handler = h
	if opts.Log.GetLevel() == zerolog.TraceLevel { // the zero value
		opts.Log = zerolog.Nop()
	}
	s := Serve(ln, opts)
	t.Cleanup(func() { _ = s.Close() })
	return s, ln.Addr().String()
}

// open reports the open connections of a ConnLimit.
func open(l *ConnLimit) int {
	n, _, _ := l.Stats()
	return n
}

// A flood of idle connections (some never sent a request, some kept open after one) does not
// stop the server from answering a new one, and never holds more than the cap.
func TestFloodKeepsServing(t *testing.T) {
	const max = 16
	conns := NewConnLimit(max, zerolog.Nop())
	_, addr := start(t, ok, Options{Conns: conns})
	httpservetest.Flood(t, addr, 500)
	if code := httpservetest.Get(t, "http://"+addr+"/"); code != 200 {
		t.Fatalf("status %d during the flood, want 200", code)
	}
	port := httpservetest.Port(t, addr)
	httpservetest.Eventually(t, func() bool { return httpservetest.ServerConns(t, port) <= max }, func() string {
		return fmt.Sprintf("server holds %d connections, cap %d", httpservetest.ServerConns(t, port), max)
	})
	if n := open(conns); n > max {
		t.Errorf("%d connections counted open, cap %d", n, max)
	}
	if _, evicted, _ := conns.Stats(); evicted == 0 {
		t.Errorf("no idle connection closed to make room")
	}
}

// At the cap, the connection that has waited longest without a request is the one closed.
func TestEvictsLongestIdle(t *testing.T) {
	conns := NewConnLimit(3, zerolog.Nop())
	// Long timeouts: the connections are closed by the cap, not by the server's timeouts.
	_, addr := start(t, ok, Options{Conns: conns, Limits: Limits{ReadHeaderTimeout: time.Hour, IdleTimeout: time.Hour}})
	dial := func() net.Conn {
		c, err := net.DialTimeout("tcp", addr, httpservetest.WaitTimeout)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	// idleRead reports the connections without a request in progress, and whether the server
	// has read from them all (else the cap prefers to close those it has read from).
	idleRead := func() (n int, all bool) {
		conns.mu.Lock()
		defer conns.mu.Unlock()
		all = true
		for el := conns.idle.Front(); el != nil; el = el.Next() {
			all = all && el.Value.(*connEntry).conn.reading.Load()
		}
		return conns.idle.Len(), all
	}
	waitIdle := func(what string) {
		t.Helper()
		httpservetest.Eventually(t, func() bool { n, all := idleRead(); return n == 3 && all }, func() string {
			n, all := idleRead()
			return fmt.Sprintf("%s: %d idle (want 3), all read from: %v", what, n, all)
		})
	}
	c1, c2 := dial(), dial()
	// c2 makes a request and turns idle after c3 connected: c1 then c3 have waited longest.
	c3 := dial()
	httpservetest.Eventually(t, func() bool { return open(conns) == 3 }, func() string { return "3 connections not admitted" })
	request(t, c2)
	waitIdle("c2 after its request")
	c4 := dial()
	closedByCap(t, c1, "c1, idle since its accept")
	waitIdle("c4 admitted")
	c5 := dial()
	closedByCap(t, c3, "c3, idle since its accept")
	for _, c := range []net.Conn{c2, c4, c5} {
		request(t, c)
	}
	if _, evicted, refused := conns.Stats(); evicted != 2 || refused != 0 {
		t.Errorf("evicted %d, refused %d; want 2, 0", evicted, refused)
	}
}

// closedByCap fails unless the server closes c.
func closedByCap(t *testing.T, c net.Conn, what string) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(httpservetest.WaitTimeout))
	n, err := c.Read(make([]byte, 1))
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("%s: still open", what)
	}
	if err == nil {
		t.Fatalf("%s: read %d bytes, want it closed", what, n)
	}
}

// request sends a request on c and reads the answer, which must be 200.
func request(t *testing.T, c net.Conn) {
	t.Helper()
	_ = c.SetDeadline(time.Now().Add(httpservetest.WaitTimeout))
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: test\r\n\r\n"); err != nil {
		t.Fatalf("write request: %v", err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("read response: %v", err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	_ = c.SetDeadline(time.Time{})
}

// When every connection has a request in progress, a new one is closed at once rather than left
// waiting in the accept queue; once the requests are done, new connections are served again.
func TestRefusesWhenAllBusy(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{}, 2)
	h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		entered <- struct{}{}
		<-release
		io.WriteString(w, "ok")
	})
	conns := NewConnLimit(2, zerolog.Nop())
	_, addr := start(t, h, Options{Conns: conns})
	releaseOnce := sync.OnceFunc(func() { close(release) })
	t.Cleanup(releaseOnce) // before the server's Close, which waits for the handlers
	done := make(chan int, 2)
	for range 2 {
		go func() {
			c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: httpservetest.WaitTimeout}
			resp, err := c.Get("http://" + addr + "/")
			if err != nil {
				done <- 0
				return
			}
			resp.Body.Close()
			done <- resp.StatusCode
		}()
	}
	<-entered
	<-entered
	if got := httpservetest.ClosedByServer(t, addr, "GET / HTTP/1.1\r\nHost: test\r\n\r\n"); got != "" {
		t.Errorf("refused connection got %q", got)
	}
	if _, _, refused := conns.Stats(); refused != 1 {
		t.Errorf("refused %d connections, want 1", refused)
	}
	releaseOnce()
	for range 2 {
		if code := <-done; code != 200 {
			t.Errorf("busy request ended with %d, want 200", code)
		}
	}
	// The server closes the connections of the busy requests just after answering.
	httpservetest.Eventually(t, func() bool { return open(conns) == 0 }, func() string { return "busy connections not closed" })
	if code := httpservetest.Get(t, "http://"+addr+"/"); code != 200 {
		t.Errorf("status %d after the busy requests, want 200", code)
	}
}

// A connection that sends half a header, or nothing, is closed by the read-header timeout; one
// kept open after its request, by the idle timeout.
func TestTimeouts(t *testing.T) {
	_, addr := start(t, ok, Options{Limits: Limits{ReadHeaderTimeout: 100 * time.Millisecond, IdleTimeout: 100 * time.Millisecond}})
	for _, send := range []string{"", "GET / HTTP/1.1\r\nHost: te"} {
		if got := httpservetest.ClosedByServer(t, addr, send); got != "" && !strings.HasPrefix(got, "HTTP/1.1 408") {
			t.Errorf("after %q: got %q", send, got)
		}
	}
	got := httpservetest.ClosedByServer(t, addr, "GET / HTTP/1.1\r\nHost: test\r\n\r\n")
	if !strings.HasPrefix(got, "HTTP/1.1 200 ") {
		t.Errorf("keep-alive connection got %q, want a 200 then the close", got)
	}
}

// A header larger than the limit is refused.
func TestMaxHeaderBytes(t *testing.T) {
	_, addr := start(t, ok, Options{})
	req := "GET / HTTP/1.1\r\nHost: test\r\nX-Big: " + strings.Repeat("a", 2*DefaultMaxHeaderBytes+4096) + "\r\n\r\n"
	if got := httpservetest.ClosedByServer(t, addr, req); !strings.HasPrefix(got, "HTTP/1.1 431 ") {
		t.Errorf("got %.40q, want 431", got)
	}
}

// Servers sharing a cap: a flood of one closes idle connections of either, the other still
// answers, and closing one leaves the other's connections alone.
func TestSharedCap(t *testing.T) {
	conns := NewConnLimit(8, zerolog.Nop())
	a, addrA := start(t, ok, Options{Conns: conns})
	_, addrB := start(t, ok, Options{Conns: conns})
	httpservetest.Flood(t, addrA, 50)
	// A's accept queue is first in, first out: once a request made after the flood is answered,
	// every connection of the flood has been admitted, and none can later close c below as the
	// longest waiting.
	if code := httpservetest.Get(t, "http://"+addrA+"/"); code != 200 {
		t.Fatalf("A: status %d after its flood", code)
	}
	if code := httpservetest.Get(t, "http://"+addrB+"/"); code != 200 {
		t.Fatalf("B: status %d during A's flood", code)
	}
	if n := open(conns); n > 8 {
		t.Fatalf("%d open, cap 8", n)
	}
	c, err := net.DialTimeout("tcp", addrB, httpservetest.WaitTimeout)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	request(t, c)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	request(t, c)
	if n := httpservetest.ServerConns(t, httpservetest.Port(t, addrA)); n != 0 {
		t.Errorf("A holds %d connections after Close", n)
	}
}

// Close closes every connection and returns once the server's goroutines are gone.
func TestCloseLeavesNoGoroutine(t *testing.T) {
	check := httpservetest.CheckGoroutines(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := Serve(ln, Options{Handler: ok, Log: zerolog.Nop(), Limits: Limits{MaxConns: 32}})
	httpservetest.Flood(t, ln.Addr().String(), 100)
	if code := httpservetest.Get(t, "http://"+ln.Addr().String()+"/"); code != 200 {
		t.Fatalf("status %d", code)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if n := httpservetest.ServerConns(t, httpservetest.Port(t, ln.Addr().String())); n != 0 {
		t.Errorf("%d connections open after Close", n)
	}
	if n := open(s.conns); n != 0 {
		t.Errorf("%d connections counted open after Close", n)
	}
	check()
}

// The choice of the connection closed at the cap, on connections of no server: those read from
// go first, then the longest waiting; with every connection busy, the new one is refused.
func TestAdmitPolicy(t *testing.T) {
	newConn := func(read bool) *conn {
		a, b := net.Pipe()
		t.Cleanup(func() { a.Close(); b.Close() })
		c := &conn{Conn: a}
		c.reading.Store(read)
		return c
	}
	isClosed := func(c *conn) bool {
		return c.Conn.SetReadDeadline(time.Time{}) != nil // io.ErrClosedPipe once closed
	}
	t.Run("read from before unread", func(t *testing.T) {
		l := NewConnLimit(2, zerolog.Nop())
		unread, read, next := newConn(false), newConn(true), newConn(false)
		for _, c := range []*conn{unread, read, next} {
			if !l.admit(c, nil) {
				t.Fatal("refused")
			}
		}
		if isClosed(unread) || !isClosed(read) {
			t.Errorf("closed: unread %v, read %v; want the one read from", isClosed(unread), isClosed(read))
		}
	})
	t.Run("longest waiting when none was read from", func(t *testing.T) {
		l := NewConnLimit(2, zerolog.Nop())
		first, second, next := newConn(false), newConn(false), newConn(false)
		for _, c := range []*conn{first, second, next} {
			if !l.admit(c, nil) {
				t.Fatal("refused")
			}
		}
		if !isClosed(first) || isClosed(second) {
			t.Errorf("closed: first %v, second %v; want the first", isClosed(first), isClosed(second))
		}
	})
	t.Run("idle again after a request", func(t *testing.T) {
		l := NewConnLimit(2, zerolog.Nop())
		a, b, next := newConn(true), newConn(true), newConn(false)
		l.admit(a, nil)
		l.admit(b, nil)
		l.setState(a, http.StateActive)
		l.setState(a, http.StateIdle)
		l.admit(next, nil)
		if isClosed(a) || !isClosed(b) {
			t.Errorf("closed: a %v, b %v; want b, idle longer", isClosed(a), isClosed(b))
		}
	})
	t.Run("all busy", func(t *testing.T) {
		l := NewConnLimit(1, zerolog.Nop())
		busy, next := newConn(true), newConn(false)
		l.admit(busy, nil)
		l.setState(busy, http.StateActive)
		if l.admit(next, nil) {
			t.Fatal("admitted while every connection is busy")
		}
		if isClosed(busy) || !isClosed(next) {
			t.Errorf("closed: busy %v, new %v; want the new one", isClosed(busy), isClosed(next))
		}
		l.setState(busy, http.StateClosed)
		if n, evicted, refused := l.Stats(); n != 0 || evicted != 0 || refused != 1 {
			t.Errorf("stats %d open, %d evicted, %d refused; want 0, 0, 1", n, evicted, refused)
		}
	})
}

// Shutdown, as after a hand-over: the request in progress finishes, and a connection that
// arrives meanwhile waits in the shared socket's backlog for the successor serving another
// descriptor of the same socket, rather than being taken and cut.
func TestShutdownHandsWaitingConnectionsOn(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f, err := ln.(*net.TCPListener).File() // the successor's copy of the socket
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	inHandler, release := make(chan struct{}), make(chan struct{})
	slow := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		close(inHandler)
		<-release
		io.WriteString(w, "old")
	})
	old := Serve(ln, Options{Handler: slow, Log: zerolog.Nop()})
	t.Cleanup(func() { _ = old.Close() })

	inFlight, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer inFlight.Close()
	answered := make(chan error, 1)
	go func() {
		_ = inFlight.SetDeadline(time.Now().Add(httpservetest.WaitTimeout))
		if _, err := io.WriteString(inFlight, "GET / HTTP/1.1\r\nHost: test\r\n\r\n"); err != nil {
			answered <- err
			return
		}
		resp, err := http.ReadResponse(bufio.NewReader(inFlight), nil)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode != 200 {
				err = fmt.Errorf("status %d", resp.StatusCode)
			}
		}
		answered <- err
	}()
	<-inHandler
	shutdown := make(chan error, 1)
	go func() { shutdown <- old.Shutdown(t.Context()) }()
	// Shutdown closes the old server's listener first thing: wait for that (a closed listener's
	// descriptor refuses SetDeadline).
	for deadline := time.Now().Add(httpservetest.WaitTimeout); ln.(*net.TCPListener).SetDeadline(time.Time{}) == nil; {
		if time.Now().After(deadline) {
			t.Fatal("Shutdown did not close the listener")
		}
		time.Sleep(time.Millisecond)
	}
	waiting, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("a new connection during the shutdown: %v (the socket must stay listening)", err)
	}
	defer waiting.Close()

	close(release)
	if err := <-answered; err != nil {
		t.Errorf("the request in progress: %v", err)
	}
	if err := <-shutdown; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
	// The successor serves the other descriptor: the waiting connection is answered.
	lnf, err := net.FileListener(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	succ := Serve(lnf, Options{Handler: ok, Log: zerolog.Nop()})
	t.Cleanup(func() { _ = succ.Close() })
	request(t, waiting)
}

// A connection accepted just before Shutdown, whose request comes after Shutdown began, is
// answered (http.Server.Shutdown would read the request and close the connection unanswered: a
// health probe failing during a hand-over).
func TestShutdownAnswersAcceptedConnection(t *testing.T) {
	s, addr := start(t, ok, Options{})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	eventually := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(httpservetest.WaitTimeout); !cond(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	eventually("the connection to be accepted", func() bool { return open(s.conns) == 1 })
	shutdown := make(chan error, 1)
	go func() { shutdown <- s.Shutdown(t.Context()) }()
	eventually("Shutdown to close the listener", func() bool { return s.draining.Load() })
	request(t, c)
	if err := <-shutdown; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
}
