//go:build sockmapmeasure

// The sockmap reference relay against splice: go test -tags sockmapmeasure -run '^$' -bench
// Sockmap ./proxy/forward/

package forward

import (
	"bufio"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Issue 15: one stream through the proxy's splice relay against the reference sockmap relay of
// sockmap_linux_test.go, with Direct (no proxy) as the baseline, the three modes in each run
// (bench/README.md, "Issue 15, session 26", ran five binaries of -count 1 for interleaved
// rounds: -count 5 repeats each mode before the next):
//
//	go test -tags sockmapmeasure -run '^$' -bench Sockmap -benchtime 8192x ./proxy/forward
//
// cpu-µs/op is this process's CPU time (client, backend and relay); sys-cpu-µs/op is the whole
// machine's busy time from /proc/stat, which also counts the kernel workers that send the
// sockmap's redirected skbs (sk_psock_backlog runs in a kworker, charged to no process).

var sockmapModes = []string{"Direct", "Splice", "Sockmap"}

// sockmapTarget returns the address to dial for mode in front of backend, and for Sockmap the
// relay (whose dialPaired waits until the connection is in the map).
func sockmapTarget(b *testing.B, mode string, backend netip.AddrPort) (netip.AddrPort, *smListener) {
	switch mode {
	case "Splice":
		return startedTCPProxy(b, backend), nil
	case "Sockmap":
		s := startSockmapRelay(b, backend)
		return s.addr(), s
	}
	return backend, nil
}

func dialMode(b *testing.B, target netip.AddrPort, s *smListener) *net.TCPConn {
	if s != nil {
		c, _ := s.dialPaired(b)
		return c
	}
	return dialTCPTest(b, target)
}

// BenchmarkSockmapBulk: one stream of 64 KiB writes to a backend that reads to EOF; MB/s is the
// payload's rate, and an op ends when the backend has read everything.
func BenchmarkSockmapBulk(b *testing.B) {
	const chunk = 64 << 10
	for _, mode := range sockmapModes {
		b.Run(mode, func(b *testing.B) {
			got := make(chan int64, 1)
			backend := startTCPServer(b, loopback("4"), func(c *net.TCPConn) {
				n, _ := io.CopyBuffer(io.Discard, c, make([]byte, 256<<10))
				got <- n
			})
			target, s := sockmapTarget(b, mode, backend)
			c := dialMode(b, target, s)
			c.SetDeadline(time.Time{})
			buf := make([]byte, chunk)
			b.SetBytes(chunk)
			b.ResetTimer()
			cpu, sys := cpuTime(), machineBusy()
			for range b.N {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
			if err := c.CloseWrite(); err != nil {
				b.Fatal(err)
			}
			if n := <-got; n != int64(b.N)*chunk {
				b.Fatalf("backend read %d bytes, want %d", n, int64(b.N)*chunk)
			}
			b.StopTimer()
			reportCPU(b, cpu)
			b.ReportMetric(float64(machineBusy()-sys)/float64(time.Microsecond)/float64(b.N), "sys-cpu-µs/op")
			if s != nil && s.r.copied.Load() != 0 {
				b.Fatalf("%d bytes went through user space", s.r.copied.Load())
			}
		})
	}
}

// BenchmarkSockmapRequestResponse: one keep-alive connection to an echo backend; an op writes
// 64 bytes and reads the 64-byte answer.
func BenchmarkSockmapRequestResponse(b *testing.B) {
	for _, mode := range sockmapModes {
		b.Run(mode, func(b *testing.B) {
			target, s := sockmapTarget(b, mode, startTCPEcho(b, loopback("4")))
			c := dialMode(b, target, s)
			c.SetDeadline(time.Time{})
			req, reply := make([]byte, 64), make([]byte, 64)
			b.ResetTimer()
			cpu, sys := cpuTime(), machineBusy()
			for range b.N {
				if _, err := c.Write(req); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, reply); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			reportCPU(b, cpu)
			b.ReportMetric(float64(machineBusy()-sys)/float64(time.Microsecond)/float64(b.N), "sys-cpu-µs/op")
			if s != nil && s.r.copied.Load() != 0 {
				b.Fatalf("%d bytes went through user space", s.r.copied.Load())
			}
		})
	}
}

// machineBusy returns the time all CPUs of the machine have spent busy (/proc/stat: all but
// idle and iowait), at the kernel's 10 ms tick.
func machineBusy() time.Duration {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return 0
	}
	defer f.Close()
	line, _ := bufio.NewReader(f).ReadString('\n')
	fields := strings.Fields(line)
	var busy int64
	for i, v := range fields[1:] {
		n, _ := strconv.ParseInt(v, 10, 64)
		if i != 3 && i != 4 && i < 8 { // idle, iowait; guest time is in user already
			busy += n
		}
	}
	return time.Duration(busy) * 10 * time.Millisecond
}
