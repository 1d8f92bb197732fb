// Package httpservetest floods HTTP servers with idle connections, counts the connections a
// server holds and checks that stalled connections are closed, for the tests of the servers that
// package httpserve hardens. Every helper talks to loopback addresses only.
package httpservetest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// WaitTimeout bounds every wait of these helpers. It is a guard against hangs, not a
// measurement: reaching it fails the test.
const WaitTimeout = 5 * time.Second

// Flood opens n connections to addr, each holding a server connection without a request in
// progress: the even ones send one complete request (whose answer they never read) and stay open
// after it (keep-alive), the odd ones send nothing. They are closed at the end of the test.
func Flood(t testing.TB, addr string, n int) {
	t.Helper()
	conns := make([]net.Conn, 0, n)
	t.Cleanup(func() {
		for _, c := range conns {
			_ = c.Close()
		}
	})
	for i := range n {
		c, err := net.DialTimeout("tcp", addr, WaitTimeout)
		if errors.Is(err, syscall.ECONNRESET) {
			continue // closed by the server as soon as accepted, before connect returned
		}
		if err != nil {
			t.Fatalf("flood: connection %d to %s: %v", i, addr, err)
		}
		conns = append(conns, c)
		if i%2 == 0 {
			// A server that has closed the connection already may reset it: never mind.
			_, _ = io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: flood\r\n\r\n")
		}
	}
}

// Get makes one request on a new connection and returns the status; it fails the test when no
// answer comes within WaitTimeout.
func Get(t testing.TB, url string) int {
	t.Helper()
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: WaitTimeout}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatalf("GET %s: reading the body: %v", url, err)
	}
	return resp.StatusCode
}

// ServerConns returns how many of the connections accepted on port are open in this process:
// the sockets of /proc/self/net/tcp and tcp6 whose local port is port, that are not listening and
// that have an inode (a descriptor; sockets still in the accept queue, or closed and lingering,
// have none).
func ServerConns(t testing.TB, port int) int {
	t.Helper()
	n := 0
	for _, f := range []string{"/proc/self/net/tcp", "/proc/self/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatalf("count connections: %v", err)
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fields := strings.Fields(line)
			if len(fields) < 10 {
				continue
			}
			_, p, ok := strings.Cut(fields[1], ":")
			if !ok {
				continue
			}
			local, err := strconv.ParseUint(p, 16, 16)
			if err != nil || int(local) != port {
				continue
			}
			const listen = "0A"
			if fields[3] != listen && fields[9] != "0" {
				n++
			}
		}
	}
	return n
}

// Port returns the port of a host:port address.
func Port(t testing.TB, addr string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// Eventually polls cond until it holds, failing the test after WaitTimeout with the message
// msg returns.
func Eventually(t testing.TB, cond func() bool, msg func() string) {
	t.Helper()
	deadline := time.Now().Add(WaitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", WaitTimeout, msg())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ClosedByServer dials addr, sends send (say, half a request header), and waits for the server
// to close the connection (a reset counts); it fails the test if the connection is still open
// after WaitTimeout. Whatever the server answers before closing (say, a 408) is returned.
func ClosedByServer(t testing.TB, addr, send string) string {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, WaitTimeout)
	if errors.Is(err, syscall.ECONNRESET) {
		return "" // closed as soon as accepted
	}
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	defer c.Close()
	if send != "" {
		_, err := io.WriteString(c, send)
		if errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
			return ""
		}
		if err != nil {
			t.Fatalf("write to %s: %v", addr, err)
		}
	}
	_ = c.SetReadDeadline(time.Now().Add(WaitTimeout))
	got, err := io.ReadAll(bufio.NewReader(c))
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("connection to %s that sent %q still open after %v", addr, send, WaitTimeout)
	}
	return string(got)
}

// CheckGoroutines returns a function that fails the test unless the number of goroutines comes
// back to what it is now (polling up to WaitTimeout), printing them if it does not.
func CheckGoroutines(t testing.TB) func() {
	before := runtime.NumGoroutine()
	return func() {
		t.Helper()
		Eventually(t, func() bool { return runtime.NumGoroutine() <= before }, func() string {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			return fmt.Sprintf("%d goroutines, %d before:\n%s", runtime.NumGoroutine(), before, buf)
		})
	}
}
