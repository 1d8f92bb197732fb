//go:build linux

package tcp

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
)

// backendEnv passes the backend address to helper processes; spliceModeEnv, when "transparent-v2",
// makes the splice child dial transparently and send a PROXY protocol v2 header first.
const (
	backendEnv    = "KUP_FORWARD_BACKEND"
	spliceModeEnv = "KUP_FORWARD_SPLICE_MODE"
)

// spliceChild is the helper process of TestTCPSplice: it runs only a Proxy (no client, no
// backend), so every splice(2) it makes is the proxy's. It prints "ADDR <proxy address>" and
// serves until its stdin closes.
func spliceChild() int {
	backend, err := netip.ParseAddrPort(os.Getenv(backendEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, "backend address:", err)
		return 2
	}
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		return 2
	}
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}
	if os.Getenv(spliceModeEnv) == "transparent-v2" {
		chooser.Transparent, chooser.ProxyProtocol = true, proxyproto.V2
	}
	loops, err := NewLoops(2)
	if err != nil {
		fmt.Fprintln(os.Stderr, "event loops:", err)
		return 2
	}
	defer loops.Close()
	p := &Proxy{Listener: ln, Chooser: chooser, Loops: loops}
	served := make(chan error, 1)
	go func() { served <- p.Serve() }()
	fmt.Printf("ADDR %s\n", ln.Addr())
	io.Copy(io.Discard, os.Stdin)
	if err := p.Shutdown(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "shutdown:", err)
		return 1
	}
	if err := <-served; err != nil {
		fmt.Fprintln(os.Stderr, "serve:", err)
		return 1
	}
	return 0
}

// traceLine matches a completed system call in strace -f -o output: "PID name(...) = R" or
// "PID <... name resumed>...) = R" ("[pid PID]" when strace writes to a terminal).
var traceLine = regexp.MustCompile(`^(?:\[pid\s+\d+\]\s+|\d+\s+)?(?:<\.\.\. (\w+) resumed>|(\w+)\().*\)\s+=\s+(-?\d+)`)

// TestTCPSplice proves that the proxy moves bulk payload with splice(2), not through user
// space: it runs the proxy in a child process under strace, sends data through it, and checks
// that the bytes the child's splice calls moved are four times the payload (client→pipe,
// pipe→endpoint, endpoint→pipe, pipe→client) but for the few buffers each direction copies
// before it switches to splice, while its read/write-family calls moved only those. It does so for a plain connection and for a transparent one that starts with a PROXY
// protocol header (written, not spliced).
func TestTCPSplice(t *testing.T) {
	for _, mode := range []string{"plain", "transparent-v2"} {
		t.Run(mode, func(t *testing.T) { testTCPSplice(t, mode) })
	}
}

func testTCPSplice(t *testing.T, mode string) {
	checkNoLeaks(t)
	strace, err := exec.LookPath("strace")
	if err != nil {
		t.Fatalf("strace is required to prove splice (apt-get install strace): %v", err)
	}
	const payload = 8 << 20
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	headerErr := make(chan error, 1)
	if mode == "transparent-v2" {
		// The endpoint checks and strips the 28-byte header (IPv4), then echoes.
		backend = forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), func(c *net.TCPConn) {
			hdr := make([]byte, 28)
			_, err := io.ReadFull(c, hdr)
			if err == nil {
				src := netip.MustParseAddrPort(c.RemoteAddr().String())
				if !bytes.Equal(hdr[:12], []byte("\r\n\r\n\x00\r\nQUIT\n")) || hdr[12] != 0x21 || hdr[13] != 0x11 ||
					netip.AddrFrom4([4]byte(hdr[16:20])) != src.Addr() {
					err = fmt.Errorf("bad PROXY v2 header % x from %v", hdr, src)
				}
			}
			headerErr <- err
			forwardtest.EchoTCP(c)
		})
	} else {
		headerErr <- nil
	}

	trace := filepath.Join(t.TempDir(), "strace.out")
	cmd := exec.Command(strace, "-f", "-qq", "-C", "-o", trace,
		"-e", "trace=splice,read,write,readv,writev,recvfrom,sendto,recvmsg,sendmsg",
		"-e", "signal=none", os.Args[0])
	cmd.Env = append(os.Environ(), childEnv+"=splice", backendEnv+"="+backend.String(), spliceModeEnv+"="+mode)
	child := forwardtest.StartChild(t, cmd)
	stderr := &child.Stderr
	line, err := bufio.NewReader(child.Stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("reading the child's address: %v (stderr: %s)", err, stderr.String())
	}
	proxyAddr, err := netip.ParseAddrPort(strings.TrimSpace(strings.TrimPrefix(line, "ADDR ")))
	if err != nil {
		t.Fatalf("child said %q: %v", line, err)
	}

	c := forwardtest.DialTCP(t, proxyAddr)
	c.SetDeadline(time.Now().Add(5 * time.Minute))
	msg := make([]byte, payload)
	rand.NewChaCha8([32]byte{3}).Read(msg)
	werr := make(chan error, 1)
	go func() {
		_, err := c.Write(msg)
		if err == nil {
			err = c.CloseWrite()
		}
		werr <- err
	}()
	got, err := io.ReadAll(c)
	if err != nil || <-werr != nil {
		t.Fatalf("transfer through the proxy: read %v", err)
	}
	if !bytes.Equal(got, msg) {
		t.Fatalf("echo differs: %d bytes, want %d", len(got), len(msg))
	}
	if err := <-headerErr; err != nil {
		t.Fatal(err)
	}
	c.Close()
	if err := child.Wait(); err != nil {
		t.Fatalf("child: %v (stderr: %s)", err, stderr.String())
	}

	out, err := os.ReadFile(trace)
	if err != nil {
		t.Fatal(err)
	}
	calls, moved := map[string]int{}, map[string]int64{}
	var summary []string
	inSummary := false
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, "% time") {
			inSummary = true
		}
		if inSummary {
			summary = append(summary, l)
			continue
		}
		m := traceLine.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		name := m[1] + m[2]
		calls[name]++
		if r, _ := strconv.ParseInt(m[3], 10, 64); r > 0 {
			moved[name] += r
		}
	}
	t.Logf("strace -f -C summary of the proxy process (%d-byte payload echoed):\n%s", payload, strings.Join(summary, "\n"))
	var other int64
	for name, n := range moved {
		t.Logf("%-8s %6d completed calls, %10d bytes", name, calls[name], n)
		if name != "splice" {
			other += n
		}
	}
	// Each direction copies through the loop's buffer until a read fills it (splice-auto),
	// then splices: all but the first few buffers of the payload go through splice.
	const copiedMax = 16 * loopBufSize
	if want := int64(4 * payload); moved["splice"] < want-copiedMax || moved["splice"] > want {
		t.Errorf("splice moved %d bytes, want %d (4 × payload) less at most %d: payload bypassed splice", moved["splice"], want, copiedMax)
	}
	if other >= copiedMax {
		t.Errorf("read/write-family calls moved %d bytes: payload went through user space", other)
	}
}
