// Command kup-load is the load generator of the benchmark in package bench. It talks to a
// kup-echo backend (one line or datagram in, one answer out), directly or through a proxy, and
// prints one JSON object with what it measured.
//
//	kup-load conn  --addr IP:PORT --duration D --max N --concurrency C   new TCP connection per request: conn/s
//	kup-load lat   --addr IP:PORT --duration D --rate R                  keep-alive requests at a fixed rate: p50/p99/p99.9
//	kup-load udprr --addr IP:PORT --duration D --concurrency C --size S  UDP request/response: req/s
//	kup-load idle  --addr IP:PORT --count N --hold D                     open N connections, print READY, hold them
//
// While idle holds its connections, SIGUSR1 makes it send one request on every one of them and
// print "CHECK ok=N failed=M ..." on stderr (how many still answer: the benchmark's hand-over row).
//
// Every mode is bounded in time (and conn in count too); it never retries a failed request.
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spf13/pflag"
)

// Result is what every mode prints (fields it does not measure stay zero).
type Result struct {
	Mode     string  `json:"mode"`
	Ops      int64   `json:"ops"`
	Errors   int64   `json:"errors"`
	Seconds  float64 `json:"seconds"`
	Rate     float64 `json:"rate"`
	P50us    float64 `json:"p50_us,omitempty"`
	P99us    float64 `json:"p99_us,omitempty"`
	P999us   float64 `json:"p999_us,omitempty"`
	FirstErr string  `json:"first_error,omitempty"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: kup-load conn|lat|udprr|idle [flags]")
		os.Exit(2)
	}
	fs := pflag.NewFlagSet(os.Args[1], pflag.ContinueOnError)
	addr := fs.String("addr", "", "IP:PORT of the kup-echo backend (or a proxy in front of it)")
	dur := fs.Duration("duration", 2*time.Second, "how long to run")
	maxOps := fs.Int64("max", 1_000_000, "conn: most connections to open")
	conc := fs.Int("concurrency", 4, "conn, udprr: parallel workers")
	rate := fs.Float64("rate", 2000, "lat: requests per second")
	size := fs.Int("size", 64, "udprr: request payload bytes")
	count := fs.Int("count", 1000, "idle: connections to hold")
	hold := fs.Duration("hold", 60*time.Second, "idle: how long to hold them at most")
	if err := fs.Parse(os.Args[2:]); err != nil {
		os.Exit(2)
	}
	var res Result
	var err error
	switch os.Args[1] {
	case "conn":
		res = connRate(*addr, *dur, *maxOps, *conc)
	case "lat":
		res = latency(*addr, *dur, *rate)
	case "udprr":
		res = udpRR(*addr, *dur, *conc, *size)
	case "idle":
		res = idle(*addr, *count, *hold)
	default:
		err = fmt.Errorf("unknown mode %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kup-load:", err)
		os.Exit(2)
	}
	res.Mode = os.Args[1]
	_ = json.NewEncoder(os.Stdout).Encode(res)
}

// errs counts failures and keeps the first one.
type errs struct {
	n     atomic.Int64
	once  sync.Once
	first string
}

func (e *errs) add(err error) {
	e.n.Add(1)
	e.once.Do(func() { e.first = err.Error() })
}

// request writes one line on c and reads the answer line.
func request(c net.Conn, r *bufio.Reader) error {
	if _, err := c.Write([]byte("x\n")); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if _, err := r.ReadSlice('\n'); err != nil {
		return fmt.Errorf("read: %w", err)
	}
	return nil
}

func connRate(addr string, d time.Duration, maxOps int64, conc int) Result {
	var ops atomic.Int64
	var e errs
	start := time.Now()
	deadline := start.Add(d)
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			for time.Now().Before(deadline) && ops.Load()+e.n.Load() < maxOps {
				if err := oneConn(addr, deadline.Add(time.Second)); err != nil {
					e.add(err)
					continue
				}
				ops.Add(1)
			}
		})
	}
	wg.Wait()
	secs := time.Since(start).Seconds()
	return Result{Ops: ops.Load(), Errors: e.n.Load(), Seconds: secs, Rate: float64(ops.Load()) / secs, FirstErr: e.first}
}

func oneConn(addr string, deadline time.Time) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return fmt.Errorf("dial: %w", err)
	}
	defer c.Close()
	_ = c.SetDeadline(deadline)
	return request(c, bufio.NewReaderSize(c, 256))
}

func latency(addr string, d time.Duration, rate float64) Result {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return Result{Errors: 1, FirstErr: err.Error()}
	}
	defer c.Close()
	r := bufio.NewReaderSize(c, 256)
	interval := time.Duration(float64(time.Second) / rate)
	start := time.Now()
	var lats []time.Duration
	var e errs
	// Open loop on a schedule: a late reply delays the next send, and the latency is counted
	// from the scheduled time, so a stall is not hidden (no coordinated omission).
	for i := 0; ; i++ {
		at := start.Add(time.Duration(i) * interval)
		if at.Sub(start) >= d {
			break
		}
		if w := time.Until(at); w > 0 {
			time.Sleep(w)
		}
		_ = c.SetDeadline(time.Now().Add(time.Second))
		if err := request(c, r); err != nil {
			e.add(err)
			break
		}
		lats = append(lats, time.Since(at))
	}
	secs := time.Since(start).Seconds()
	slices.Sort(lats)
	q := func(p float64) float64 {
		if len(lats) == 0 {
			return 0
		}
		i := min(len(lats)-1, int(p*float64(len(lats))))
		return float64(lats[i].Nanoseconds()) / 1e3
	}
	return Result{Ops: int64(len(lats)), Errors: e.n.Load(), Seconds: secs, Rate: float64(len(lats)) / secs,
		P50us: q(0.50), P99us: q(0.99), P999us: q(0.999), FirstErr: e.first}
}

func udpRR(addr string, d time.Duration, conc, size int) Result {
	var ops atomic.Int64
	var e errs
	start := time.Now()
	deadline := start.Add(d)
	payload := make([]byte, size)
	for i := range payload {
		payload[i] = 'a'
	}
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			c, err := net.Dial("udp", addr)
			if err != nil {
				e.add(err)
				return
			}
			defer c.Close()
			buf := make([]byte, 2048)
			for time.Now().Before(deadline) {
				if _, err := c.Write(payload); err != nil {
					e.add(err)
					continue
				}
				_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
				if _, err := c.Read(buf); err != nil {
					e.add(err) // a lost datagram: counted, not retried
					continue
				}
				ops.Add(1)
			}
		})
	}
	wg.Wait()
	secs := time.Since(start).Seconds()
	return Result{Ops: ops.Load(), Errors: e.n.Load(), Seconds: secs, Rate: float64(ops.Load()) / secs, FirstErr: e.first}
}

// idle opens count connections (8 dialers), checks each with one request, prints "READY <n>" on
// stderr and holds them for hold (the benchmark kills it once it has measured). On SIGUSR1 it
// checks every connection it holds (see check).
func idle(addr string, count int, hold time.Duration) Result {
	start := time.Now()
	usr1 := make(chan os.Signal, 1)
	notifyCheck(usr1)
	conns := make([]net.Conn, 0, count)
	var mu sync.Mutex
	var e errs
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for next.Add(1) <= int64(count) {
				if e.n.Load() > 0 {
					return // stop at the first failure: it is usually the fd limit
				}
				c, err := net.DialTimeout("tcp", addr, 2*time.Second)
				if err != nil {
					e.add(fmt.Errorf("dial: %w", err))
					return
				}
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				if err := request(c, bufio.NewReaderSize(c, 64)); err != nil {
					c.Close()
					e.add(err)
					return
				}
				_ = c.SetDeadline(time.Time{})
				mu.Lock()
				conns = append(conns, c)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	fmt.Fprintf(os.Stderr, "READY %d\n", len(conns))
	end := time.After(hold) // the benchmark usually kills it earlier, once it has measured
	for held := true; held; {
		select {
		case <-usr1:
			check(conns)
		case <-end:
			held = false
		}
	}
	for _, c := range conns {
		c.Close()
	}
	if e.first == "" && len(conns) < count {
		e.add(errors.New("fewer connections than asked"))
	}
	return Result{Ops: int64(len(conns)), Errors: e.n.Load(), Seconds: time.Since(start).Seconds(), FirstErr: e.first}
}

// check sends one request on every connection (8 at a time, all within 10 s) and prints on
// stderr "CHECK ok=N failed=M reset=R eof=E timeout=T took=D first=ERR": ok answered; of the
// failed, reset saw ECONNRESET (or EPIPE), eof a close, timeout no answer in time.
func check(conns []net.Conn) {
	start := time.Now()
	deadline := start.Add(10 * time.Second)
	var ok, reset, eof, timeout atomic.Int64
	var e errs
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for i := next.Add(1) - 1; i < int64(len(conns)); i = next.Add(1) - 1 {
				c := conns[i]
				_ = c.SetDeadline(deadline)
				err := request(c, bufio.NewReaderSize(c, 64))
				_ = c.SetDeadline(time.Time{})
				var ne net.Error
				switch {
				case err == nil:
					ok.Add(1)
					continue
				case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
					reset.Add(1)
				case errors.Is(err, io.EOF):
					eof.Add(1)
				case errors.As(err, &ne) && ne.Timeout():
					timeout.Add(1)
				}
				e.add(err)
			}
		})
	}
	wg.Wait()
	fmt.Fprintf(os.Stderr, "CHECK ok=%d failed=%d reset=%d eof=%d timeout=%d took=%v first=%q\n",
		ok.Load(), e.n.Load(), reset.Load(), eof.Load(), timeout.Load(), time.Since(start).Round(time.Millisecond), e.first)
}
