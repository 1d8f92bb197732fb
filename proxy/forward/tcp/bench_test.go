//go:build linux

package tcp

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"github.com/rs/zerolog"
)

// The benchmarks run each workload against a loopback backend twice in the same run: Direct
// (client to backend) and Proxy (client to a Proxy in front of the same backend),
// so the ratio of the two is the proxy's cost on this machine. The Proxy runs on two event
// loops of its own, as the proxier places a service port on two of its loops.

// tcpTarget returns the address a benchmark's clients dial: the backend, or a proxy in front
// of it.
func tcpTarget(b *testing.B, proxied bool, backend netip.AddrPort) netip.AddrPort {
	if !proxied {
		return backend
	}
	return startTCPProxy(b, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.Log = new(zerolog.Nop())
	}).addr
}

var benchModes = []struct {
	name    string
	proxied bool
}{{"Direct", false}, {"Proxy", true}}

// BenchmarkTCPBulk streams data through one connection to an echo backend and back; MB/s counts
// one direction.
func BenchmarkTCPBulk(b *testing.B) {
	const chunk = 128 << 10
	for _, mode := range benchModes {
		b.Run(mode.name, func(b *testing.B) {
			backend := forwardtest.StartTCPEcho(b, forwardtest.Loopback("4"))
			target := tcpTarget(b, mode.proxied, backend)
			c := forwardtest.DialTCP(b, target)
			c.SetDeadline(time.Time{})
			buf := make([]byte, chunk)
			b.SetBytes(chunk)
			b.ResetTimer()
			werr := make(chan error, 1)
			go func() {
				var err error
				for i := 0; i < b.N && err == nil; i++ {
					_, err = c.Write(buf)
				}
				if err == nil {
					err = c.CloseWrite()
				}
				werr <- err
			}()
			n, err := io.CopyBuffer(io.Discard, c, make([]byte, chunk))
			if err != nil || <-werr != nil {
				b.Fatalf("transfer: %v", err)
			}
			if n != int64(b.N)*chunk {
				b.Fatalf("received %d bytes, want %d", n, int64(b.N)*chunk)
			}
		})
	}
}

// requestServer reads one 64-byte request, answers it and closes (server closes first, so
// TIME_WAIT stays on the server side and the client's ports do not run out).
func requestServer(c *net.TCPConn) {
	req := make([]byte, 64)
	if _, err := io.ReadFull(c, req); err == nil {
		c.Write(req)
	}
}

// BenchmarkTCPShortConnections: connect, send one 64-byte request, read the answer to EOF,
// close.
func BenchmarkTCPShortConnections(b *testing.B) {
	for _, mode := range benchModes {
		b.Run(mode.name, func(b *testing.B) {
			backend := forwardtest.StartTCPServer(b, forwardtest.Loopback("4"), requestServer)
			target := net.TCPAddrFromAddrPort(tcpTarget(b, mode.proxied, backend))
			req := make([]byte, 64)
			reply := make([]byte, 128)
			b.ResetTimer()
			cpu := cpuTime()
			defer func() { reportCPU(b, cpu) }()
			for range b.N {
				c, err := net.DialTCP("tcp", nil, target)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := c.Write(req); err != nil {
					b.Fatal(err)
				}
				n, err := io.ReadFull(c, reply)
				if n != 64 || !errors.Is(err, io.ErrUnexpectedEOF) {
					b.Fatalf("reply: %d bytes, %v", n, err)
				}
				c.Close()
			}
		})
	}
}

// BenchmarkTCPRequestResponse: one keep-alive connection to an echo backend; each op writes a
// 64-byte request and reads the 64-byte answer, so ns/op is one round trip (the keep-alive
// latency of the full bench, without its network namespaces).
func BenchmarkTCPRequestResponse(b *testing.B) {
	for _, mode := range benchModes {
		b.Run(mode.name, func(b *testing.B) {
			backend := forwardtest.StartTCPEcho(b, forwardtest.Loopback("4"))
			target := tcpTarget(b, mode.proxied, backend)
			c := forwardtest.DialTCP(b, target)
			c.SetDeadline(time.Time{})
			req := make([]byte, 64)
			reply := make([]byte, 64)
			b.ResetTimer()
			cpu := cpuTime()
			defer func() { reportCPU(b, cpu) }()
			for range b.N {
				if _, err := c.Write(req); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, reply); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkTCPIdleConnections holds idleConns connections, each after one echoed request, and
// reports the Go memory (heap in use plus goroutine stacks, after a GC) per connection. Client
// and backend (startIdleBackend) live in this process too, so the proxy's own cost per idle
// connection is Proxy's figure minus Direct's. b.N is ignored beyond running the measurement once per round.
// Connections are measured after idleSettle.
func BenchmarkTCPIdleConnections(b *testing.B) {
	const idleConns = 2000
	for _, mode := range benchModes {
		b.Run(mode.name, func(b *testing.B) {
			backend := startIdleBackend(b)
			target := tcpTarget(b, mode.proxied, backend)
			var perConn, stackPer, otherPer float64
			for range b.N {
				before := goMemory()
				sb := stackMemory()
				ob := otherMemory()
				conns := make([]*net.TCPConn, 0, idleConns)
				msg := []byte("ping")
				for range idleConns {
					c := forwardtest.DialTCP(b, target)
					if _, err := forwardtest.RoundTrip(c, msg); err != nil {
						b.Fatalf("round trip: %v", err)
					}
					conns = append(conns, c)
				}
				time.Sleep(idleSettle)
				perConn = float64(goMemory()-before) / idleConns
				stackPer = float64(stackMemory()-sb) / idleConns
				otherPer = float64(otherMemory()-ob) / idleConns
				for _, c := range conns {
					c.Close()
				}
			}
			b.ReportMetric(perConn, "B/idle-conn")
			b.ReportMetric(stackPer, "stackB/idle-conn")
			b.ReportMetric(otherPer, "otherB/idle-conn")
		})
	}
}

// startIdleBackend serves BenchmarkTCPIdleConnections' connections without a goroutine each:
// its accept loop echoes the first four bytes of each connection, then keeps it open until the
// benchmark ends. (An echo goroutine per connection would hold a stack per connection in the
// stack spans the proxy's goroutines use, so that the memory the proxy's goroutines give back
// could not be told.)
func startIdleBackend(b *testing.B) netip.AddrPort {
	ln := forwardtest.ListenTCP(b, forwardtest.Loopback("4"))
	done := make(chan struct{})
	go func() {
		defer close(done)
		var conns []*net.TCPConn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		buf := make([]byte, 4)
		for {
			c, err := ln.AcceptTCP()
			if err != nil {
				return
			}
			conns = append(conns, c)
			c.SetDeadline(time.Now().Add(forwardtest.WaitTimeout))
			if _, err := io.ReadFull(c, buf); err == nil {
				c.Write(buf)
			}
		}
	}()
	b.Cleanup(func() {
		ln.Close()
		<-done
	})
	return forwardtest.ListenerAddr(ln)
}

// idleSettle is how long BenchmarkTCPIdleConnections lets its connections idle before it
// measures them.
// connections are idle by then, and the garbage the burst of connecting left is collectable.
const idleSettle = 500 * time.Millisecond

// goMemory returns the heap in use plus the goroutine stacks, after a collection.
func goMemory() int64 {
	var ms runtime.MemStats
	for range 6 {
		runtime.GC()
	}
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapInuse + ms.StackInuse)
}

// otherMemory returns the runtime's memory outside the heap, stacks and GC metadata
// (MemStats.OtherSys), which holds the pollDesc of every socket in the runtime's poller (~558
// bytes each, reused but never freed): it grows only past the most sockets the process had
// open at once, so its figure per idle connection holds for the first measurement of a process
// (run a mode alone: -bench 'TCPIdleConnections/^Proxy$' -count 1).
func otherMemory() int64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.OtherSys)
}

func stackMemory() int64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.StackInuse)
}

// cpuTime returns the CPU time (user and system) this process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// reportCPU reports the process's CPU time per op since start (client, backend and proxy
// alike: the proxy's share is Proxy's figure minus Direct's). Less sensitive than ns/op to
// other load on the machine.
func reportCPU(b *testing.B, start time.Duration) {
	b.ReportMetric(float64(cpuTime()-start)/float64(time.Microsecond)/float64(b.N), "cpu-µs/op")
}

// BenchmarkLoopSweep is the cost of one second of a loop's sweeps (100 ticks of loopTickBusy)
// while a dial is in progress, with idleConns connections of a proxy with an IdleTimeout
// of 10 s on the loop (their checks are due every idleTick, 1 s). The connections are the
// loop's bookkeeping only, with no sockets: nothing expires, so this is the walking alone.
func BenchmarkLoopSweep(b *testing.B) {
	const idleConns = 10_000
	l, err := newLoop()
	if err != nil {
		b.Fatal(err)
	}
	defer l.closeFDs()
	p := &Proxy{IdleTimeout: 10 * time.Second}
	l.fds = make([]fdSlot, idleConns+1)
	for i := range idleConns {
		c := &lconn{p: p, connected: true, last: 1 << 61} // moving data: none goes idle
		l.fds[i] = fdSlot{c: c}
		l.countTimed(c)
	}
	dialing := &lconn{p: p, connecting: true, dl: &ldial{deadline: time.Duration(1<<62 - 1)}}
	l.fds[idleConns] = fdSlot{c: dialing}
	l.dialStarted(dialing)
	b.ResetTimer()
	for range b.N {
		for range time.Second / loopTickBusy {
			l.now += loopTickBusy
			l.sweep()
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(idleConns), "conns")
}
