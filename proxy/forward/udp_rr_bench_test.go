package forward

import (
	"encoding/json"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
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
	p := &UDPProxy{Conn: conn, Chooser: &fakeChooser{endpoints: []netip.AddrPort{echoAddr}}, Log: zerolog.Nop()}
	if err := p.Start(poller); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close(); poller.Close() })
	run("proxy", conn.LocalAddr().(*net.UDPAddr).AddrPort())
}
