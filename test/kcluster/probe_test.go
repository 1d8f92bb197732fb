//go:build cluster

package kcluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// probe opens a new TCP connection to an address at a steady rate, as an impatient client does:
// each connection sends a line and must have its answer within the client's timeout. Every
// failure is kept with its time and its kind (failureKind), so that a test can say what the
// failing connections saw and when.
type probe struct {
	w       where
	address string
	timeout time.Duration
	start   time.Time

	mu       sync.Mutex  // guards the following
	okAt     []time.Time // the start of each answered connection
	failures []failure
	marks    []mark

	stop chan struct{}
	done sync.WaitGroup
}

// failure is one failed connection: when it started, how long it took to fail, and what it saw.
type failure struct {
	at   time.Time
	took time.Duration
	kind string
	err  error
}

// mark is a named moment of a scenario (a scale-down, a kill), to which failures are related.
type mark struct {
	at   time.Time
	what string
}

// The kinds of failure a client sees.
const (
	failRefused        = "refused"         // the connect was answered with a reset
	failConnectTimeout = "connect timeout" // the connect was not answered within the timeout
	failReset          = "reset"           // the connection was reset before the answer
	failClosed         = "closed"          // the connection was closed before the answer
	failTimeout        = "no answer"       // connected, but no answer within the timeout
	failOther          = "other"
)

// startProbe starts rate new connections per second from w to address, each with timeout.
func startProbe(w where, address string, rate int, timeout time.Duration) *probe {
	p := &probe{w: w, address: address, timeout: timeout, start: time.Now(), stop: make(chan struct{})}
	tick := time.NewTicker(time.Second / time.Duration(rate))
	p.done.Add(1)
	go func() {
		defer p.done.Done()
		defer tick.Stop()
		var conns sync.WaitGroup
		defer conns.Wait()
		for {
			select {
			case <-p.stop:
				return
			case at := <-tick.C:
				conns.Add(1)
				go func() {
					defer conns.Done()
					kind, err := p.once()
					p.mu.Lock()
					defer p.mu.Unlock()
					if err == nil {
						p.okAt = append(p.okAt, at)
						return
					}
					p.failures = append(p.failures, failure{at: at, took: time.Since(at), kind: kind, err: err})
				}()
			}
		}
	}()
	return p
}

// once makes one connection and classifies its failure.
func (p *probe) once() (string, error) {
	deadline := time.Now().Add(p.timeout)
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	c, err := p.w.dial(ctx, "tcp", p.address)
	if err != nil {
		switch {
		case errors.Is(err, syscall.ECONNREFUSED):
			return failRefused, err
		case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded):
			return failConnectTimeout, err
		}
		return failOther, err
	}
	defer c.Close()
	_ = c.SetDeadline(deadline)
	if _, err := io.WriteString(c, "hello\n"); err != nil {
		return classify(err), err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return classify(err), err
	}
	if f := strings.Fields(line); len(f) < 3 || f[2] != "hello" {
		return failOther, fmt.Errorf("answer %q", line)
	}
	return "", nil
}

// classify names what an established connection's read or write error means.
func classify(err error) string {
	switch {
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return failReset
	case errors.Is(err, io.EOF):
		return failClosed
	case errors.Is(err, os.ErrDeadlineExceeded):
		return failTimeout
	}
	return failOther
}

// mark notes a moment of the scenario.
func (p *probe) mark(what string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.marks = append(p.marks, mark{time.Now(), what})
}

// probeResult is what a probe saw.
type probeResult struct {
	start    time.Time
	okAt     []time.Time
	failures []failure
	marks    []mark
	took     time.Duration
}

// finish stops the probe and waits for its connections.
func (p *probe) finish() probeResult {
	close(p.stop)
	p.done.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	sort.Slice(p.failures, func(i, j int) bool { return p.failures[i].at.Before(p.failures[j].at) })
	return probeResult{start: p.start, okAt: p.okAt, failures: p.failures, marks: p.marks, took: time.Since(p.start)}
}

// split divides r at its first mark: the connections begun before it, and the others.
func (r probeResult) split() (before, after probeResult) {
	if len(r.marks) == 0 {
		return probeResult{start: r.start, marks: r.marks}, r
	}
	first := r.marks[0].at
	before = probeResult{start: r.start, marks: r.marks, took: first.Sub(r.start)}
	after = probeResult{start: first, marks: r.marks, took: r.took - before.took}
	for _, at := range r.okAt {
		if at.Before(first) {
			before.okAt = append(before.okAt, at)
		} else {
			after.okAt = append(after.okAt, at)
		}
	}
	for _, f := range r.failures {
		if f.at.Before(first) {
			before.failures = append(before.failures, f)
		} else {
			after.failures = append(after.failures, f)
		}
	}
	return before, after
}

// total is the number of connections made.
func (r probeResult) total() int { return len(r.okAt) + len(r.failures) }

// kinds counts the failures by kind, as "2 no answer, 1 reset".
func (r probeResult) kinds() string {
	n := map[string]int{}
	for _, f := range r.failures {
		n[f.kind]++
	}
	var out []string
	for k, c := range n {
		out = append(out, fmt.Sprintf("%d %s", c, k))
	}
	sort.Strings(out)
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ", ")
}

// since names the time of at after the last mark before it ("+0.62 s after scale 10 → 1").
func (r probeResult) since(at time.Time) string {
	var last *mark
	for i := range r.marks {
		if !r.marks[i].at.After(at) {
			last = &r.marks[i]
		}
	}
	if last == nil {
		return at.Format("15:04:05.000")
	}
	return fmt.Sprintf("+%.2f s after %s", at.Sub(last.at).Seconds(), last.what)
}

// summary is one line: counts and kinds.
func (r probeResult) summary() string {
	return fmt.Sprintf("%d connections in %.0f s, %d failed (%s)", r.total(), r.took.Seconds(), len(r.failures), r.kinds())
}

// report logs the summary and the first failures with their times relative to the marks.
func (r probeResult) report(t testing.TB, what string) {
	t.Helper()
	t.Logf("%s: %s", what, r.summary())
	for i, f := range r.failures {
		if i == 10 {
			t.Logf("  ... %d more", len(r.failures)-i)
			break
		}
		t.Logf("  %s, failed after %v: %s: %v", r.since(f.at), f.took.Round(time.Millisecond), f.kind, f.err)
	}
}

// dialAddr is host:port.
func dialAddr(host string, port int) string { return net.JoinHostPort(host, fmt.Sprint(port)) }
