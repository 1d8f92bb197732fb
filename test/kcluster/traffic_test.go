//go:build cluster

package kcluster

import (
	"bufio"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// where names a network namespace of the cluster that traffic starts from: "client" (outside
// the cluster) or a node's name.
type where string

// dial dials address with a socket made in the namespace (setns on a locked thread; the socket
// stays in the namespace for its whole life).
func (w where) dial(ctx context.Context, network, address string) (net.Conn, error) {
	type result struct {
		c   net.Conn
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with this goroutine
		f, err := os.Open("/run/netns/" + clusterName() + "-" + string(w))
		if err != nil {
			done <- result{err: fmt.Errorf("namespace of %s: %w", w, err)}
			return
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			done <- result{err: fmt.Errorf("setns into %s: %w", w, err)}
			return
		}
		var d net.Dialer
		c, err := d.DialContext(ctx, network, address)
		done <- result{c, err}
	}()
	r := <-done
	if r.err != nil {
		return nil, fmt.Errorf("dial %s %s from %s: %w", network, address, w, r.err)
	}
	return r.c, nil
}

// ask sends one line on a new TCP connection and returns kup-echo's answer's name and peer.
func (w where) ask(address string, timeout time.Duration) (name, peer string, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	c, err := w.dial(ctx, "tcp", address)
	if err != nil {
		return "", "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := io.WriteString(c, "hello\n"); err != nil {
		return "", "", fmt.Errorf("write to %s from %s: %w", address, w, err)
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", "", fmt.Errorf("read from %s from %s: %w", address, w, err)
	}
	f := strings.Fields(line)
	if len(f) < 3 || f[2] != "hello" {
		return "", "", fmt.Errorf("answer of %s to %s: %q", address, w, line)
	}
	return f[0], f[1], nil
}

// httpGet fetches url from the namespace.
func (w where) httpGet(url string) (int, string, error) {
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: w.dial, DisableKeepAlives: true}}
	resp, err := hc.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), err
}

// answers asks address n times and returns how often each backend answered; any failure fails.
func (w where) answers(t testing.TB, address string, n int) map[string]int {
	t.Helper()
	got := map[string]int{}
	for range n {
		name, _, err := w.ask(address, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		got[name]++
	}
	return got
}

// load sends requests, each on a new connection, at a steady rate from a namespace until
// stopped, counting failures.
type load struct {
	w       where
	address string
	ok      atomic.Int64
	mu      sync.Mutex // guards failures
	fails   []string
	stop    chan struct{}
	done    sync.WaitGroup
}

// startLoad starts rate requests per second to address from w; stop with [load.finish].
func startLoad(w where, address string, rate int) *load {
	l := &load{w: w, address: address, stop: make(chan struct{})}
	tick := time.NewTicker(time.Second / time.Duration(rate))
	l.done.Add(1)
	go func() {
		defer l.done.Done()
		defer tick.Stop()
		var reqs sync.WaitGroup
		defer reqs.Wait()
		for {
			select {
			case <-l.stop:
				return
			case at := <-tick.C:
				reqs.Add(1)
				go func() {
					defer reqs.Done()
					if _, _, err := w.ask(address, 5*time.Second); err != nil {
						l.mu.Lock()
						l.fails = append(l.fails, at.Format("15:04:05.000")+" "+err.Error())
						l.mu.Unlock()
						return
					}
					l.ok.Add(1)
				}()
			}
		}
	}()
	return l
}

// finish stops the load, waits for its requests and returns the successes and the failures.
func (l *load) finish() (int64, []string) {
	close(l.stop)
	l.done.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.ok.Load(), l.fails
}

// stream is one long TCP connection to a kup-echo backend carrying numbered lines both ways: a
// checksum of what was sent and of the payloads echoed back must agree, and no line may be lost.
type stream struct {
	c        net.Conn
	backend  string
	sent     atomic.Int64
	errc     chan error
	stop     chan struct{}
	finished chan struct{}
}

// startStream opens the connection from w and sends a line every interval until finish.
func startStream(t testing.TB, w where, address string, interval time.Duration) *stream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := w.dial(ctx, "tcp", address)
	if err != nil {
		t.Fatal(err)
	}
	s := &stream{c: c, errc: make(chan error, 2), stop: make(chan struct{}), finished: make(chan struct{})}
	out := sha256.New()
	in := sha256.New()
	lines := make(chan string, 1024)
	go func() { // the writer: numbered lines, each padded
		defer close(lines)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-s.stop:
				return
			case <-tick.C:
			}
			p := fmt.Sprintf("line-%06d-%s", i, strings.Repeat("x", i%97))
			if _, err := io.WriteString(c, p+"\n"); err != nil {
				s.errc <- fmt.Errorf("stream write %d: %w", i, err)
				return
			}
			out.Write([]byte(p))
			s.sent.Store(int64(i + 1))
			select {
			case lines <- p:
			case <-s.finished: // the reader gave up
				return
			}
		}
	}()
	go func() { // the reader: every echo in order, same backend throughout
		defer close(s.finished)
		r := bufio.NewReader(c)
		for want := range lines {
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			line, err := r.ReadString('\n')
			if err != nil {
				s.errc <- fmt.Errorf("stream read (waiting for %q): %w", want, err)
				return
			}
			f := strings.Fields(line)
			if len(f) != 3 || f[2] != want {
				s.errc <- fmt.Errorf("stream: got %q, want the echo of %q", line, want)
				return
			}
			if s.backend == "" {
				s.backend = f[0]
			} else if f[0] != s.backend {
				s.errc <- fmt.Errorf("stream: answered by %s, then by %s", s.backend, f[0])
				return
			}
			in.Write([]byte(f[2]))
		}
		if string(in.Sum(nil)) != string(out.Sum(nil)) {
			s.errc <- errors.New("stream: checksum of the echoed payloads differs from what was sent")
		}
	}()
	return s
}

// finish stops sending, waits for the last echo and reports the first error.
func (s *stream) finish() error {
	close(s.stop)
	select {
	case <-s.finished:
	case <-time.After(15 * time.Second):
		s.c.Close()
		<-s.finished
		return errors.New("stream: the last echoes did not come within 15 s")
	}
	s.c.Close()
	select {
	case err := <-s.errc:
		return err
	default:
	}
	if s.sent.Load() == 0 {
		return errors.New("stream: nothing sent")
	}
	return nil
}
