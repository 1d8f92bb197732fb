//go:build udpmeasure

// Measurements of the UDP data path with external tools; not tests: go test -tags udpmeasure -run External ./proxy/forward/ (see each function for its environment).

package forward

import (
	"encoding/json"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// TestUDPRRExternal measures UDP request/response as the benchmark of bench/ does (kup-load
// udprr, 4 sockets, 64 bytes, against kup-echo), with both tools as processes of their own and
// the proxy (started on a Poller, as the proxier starts it) in this one, so that the process's
// CPU time is the proxy's. It runs only when KUP_UDPRR_BIN names a directory holding kup-echo and
// kup-load (go build ./cmd/kup-echo ./bench/cmd/kup-load). KUP_UDPRR_DURATION (default 2s),
// KUP_UDPRR_CONC (default 4), KUP_UDPRR_DIRECT=1 also measures without the proxy.
func TestUDPRRExternal(t *testing.T) {
	dir := os.Getenv("KUP_UDPRR_BIN")
	if dir == "" {
		t.Skip("KUP_UDPRR_BIN not set")
	}
	dur := os.Getenv("KUP_UDPRR_DURATION")
	if dur == "" {
		dur = "2s"
	}
	conc := os.Getenv("KUP_UDPRR_CONC")
	if conc == "" {
		conc = "4"
	}
	echoAddr := netip.MustParseAddrPort("127.0.0.1:" + strconv.Itoa(20000+os.Getpid()%20000))
	echo := exec.Command(dir+"/kup-echo", "serve", "--listen", echoAddr.String())
	if err := echo.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { echo.Process.Kill(); echo.Wait() })
	time.Sleep(200 * time.Millisecond)

	run := func(name string, target netip.AddrPort) {
		var before, after syscall.Rusage
		syscall.Getrusage(syscall.RUSAGE_SELF, &before)
		out, err := exec.Command(dir+"/kup-load", "udprr", "--addr", target.String(), "--duration", dur,
			"--concurrency", conc, "--size", "64").Output()
		syscall.Getrusage(syscall.RUSAGE_SELF, &after)
		if err != nil {
			t.Fatalf("kup-load: %v", err)
		}
		var res struct {
			Ops    int64   `json:"ops"`
			Errors int64   `json:"errors"`
			Rate   float64 `json:"rate"`
		}
		if err := json.Unmarshal(out, &res); err != nil {
			t.Fatalf("kup-load output %q: %v", out, err)
		}
		tv := func(v syscall.Timeval) time.Duration { return time.Duration(v.Nano()) }
		user := tv(after.Utime) - tv(before.Utime)
		sys := tv(after.Stime) - tv(before.Stime)
		per := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(max(res.Ops, 1)) }
		t.Logf("%s: %.0f req/s (%d ops, %d errors); proxy CPU per round trip %.2f µs (user %.2f, sys %.2f); voluntary ctx switches %d, involuntary %d",
			name, res.Rate, res.Ops, res.Errors, per(user+sys), per(user), per(sys),
			after.Nvcsw-before.Nvcsw, after.Nivcsw-before.Nivcsw)
	}
	if os.Getenv("KUP_UDPRR_DIRECT") != "" {
		run("direct", echoAddr)
	}
	poller, err := NewPoller()
	if err != nil {
		t.Fatal(err)
	}
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	p := &UDPProxy{Conn: conn, Chooser: &fakeChooser{endpoints: []netip.AddrPort{echoAddr}}, Log: new(zerolog.Nop())}
	if err := p.Start(poller); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close(); poller.Close() })
	run("proxy", conn.LocalAddr().(*net.UDPAddr).AddrPort())
}

// TestUDPBulkExternal is TestUDPRRExternal's counterpart for the bench's UDP bulk row: iperf3
// -u -b 0 -l 1400 (KUP_UDPBULK_ARGS, default "-n 64M") from a client process through the proxy
// (its control connection through a TCPProxy on the same port) to an iperf3 server process. It
// runs only when KUP_UDPBULK=1 and iperf3 is installed; KUP_UDPRR_DIRECT=1 also runs without the
// proxy.
func TestUDPBulkExternal(t *testing.T) {
	if os.Getenv("KUP_UDPBULK") == "" {
		t.Skip("KUP_UDPBULK not set")
	}
	iperf3, err := exec.LookPath("iperf3")
	if err != nil {
		t.Skip("no iperf3")
	}
	port := 20000 + os.Getpid()%20000
	server := exec.Command(iperf3, "-s", "-B", "127.0.0.1", "-p", strconv.Itoa(port))
	if err := server.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Process.Kill(); server.Wait() })
	time.Sleep(300 * time.Millisecond)
	serverAddr := netip.MustParseAddrPort("127.0.0.1:" + strconv.Itoa(port))
	args := strings.Fields(os.Getenv("KUP_UDPBULK_ARGS"))
	if len(args) == 0 {
		args = []string{"-n", "64M"}
	}
	run := func(name string, target netip.AddrPort) {
		var before, after syscall.Rusage
		syscall.Getrusage(syscall.RUSAGE_SELF, &before)
		cmd := append([]string{"-c", target.Addr().String(), "-p", strconv.Itoa(int(target.Port())), "-J", "-u", "-b", "0", "-l", "1400"}, args...)
		out, err := exec.Command(iperf3, cmd...).Output()
		syscall.Getrusage(syscall.RUSAGE_SELF, &after)
		var res struct {
			Error string `json:"error"`
			End   struct {
				Sum struct {
					BPS     float64 `json:"bits_per_second"`
					Lost    float64 `json:"lost_percent"`
					Packets int64   `json:"packets"`
				} `json:"sum"`
			} `json:"end"`
		}
		if i := strings.Index(string(out), "{"); i < 0 || json.Unmarshal(out[i:], &res) != nil || res.Error != "" {
			t.Fatalf("iperf3: %v %s %s", err, res.Error, out)
		}
		tv := func(v syscall.Timeval) time.Duration { return time.Duration(v.Nano()) }
		cpu := tv(after.Utime) - tv(before.Utime) + tv(after.Stime) - tv(before.Stime)
		t.Logf("%s: delivered %.0f Mbit/s (sent %.0f, lost %.1f %%, %d datagrams); proxy CPU %.2f µs per datagram",
			name, res.End.Sum.BPS*(1-res.End.Sum.Lost/100)/1e6, res.End.Sum.BPS/1e6, res.End.Sum.Lost, res.End.Sum.Packets,
			float64(cpu.Nanoseconds())/1e3/float64(max(res.End.Sum.Packets, 1)))
	}
	if os.Getenv("KUP_UDPRR_DIRECT") != "" {
		run("direct", serverAddr)
	}
	poller, err := NewPoller()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { poller.Close() })
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 2)})
	if err != nil {
		t.Fatal(err)
	}
	proxyAddr := conn.LocalAddr().(*net.UDPAddr).AddrPort()
	chooser := &fakeChooser{endpoints: []netip.AddrPort{serverAddr}}
	p := &UDPProxy{Conn: conn, Chooser: chooser, Log: new(zerolog.Nop())}
	if err := p.Start(poller); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	ln, err := ListenTCP("tcp", net.TCPAddrFromAddrPort(proxyAddr))
	if err != nil {
		t.Fatal(err)
	}
	tp := &TCPProxy{Listener: ln, Chooser: chooser, Log: new(zerolog.Nop())}
	go tp.Serve()
	t.Cleanup(func() { tp.Close() })
	run("proxy", proxyAddr)
}
