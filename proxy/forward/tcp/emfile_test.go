//go:build linux

package tcp

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"github.com/rs/zerolog"
)

// emfileChild is the helper process of TestTCPOutOfFileDescriptors. It lowers its
// RLIMIT_NOFILE, serves a Proxy (JSON log on stderr) and obeys commands on stdin:
//
//	FILL <n>  open /dev/null until EMFILE, then close n of them again; answers "FILLED"
//	RELEASE   close every /dev/null; answers "RELEASED"
//
// It prints "ADDR <proxy address>" first and "PAUSE <attempt>" before each pause of the accept
// loop; it shuts down when stdin closes.
func emfileChild() int {
	backend, err := netip.ParseAddrPort(os.Getenv(backendEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, "backend address:", err)
		return 2
	}
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		fmt.Fprintln(os.Stderr, "getrlimit:", err)
		return 2
	}
	lim.Cur = 128
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		fmt.Fprintln(os.Stderr, "setrlimit:", err)
		return 2
	}
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		return 2
	}
	var outMu sync.Mutex
	say := func(format string, args ...any) {
		outMu.Lock()
		defer outMu.Unlock()
		fmt.Printf(format+"\n", args...)
	}
	p := &Proxy{
		Listener: ln,
		Chooser:  &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}},
		Log:      new(zerolog.New(os.Stderr).Level(zerolog.DebugLevel)),
		testHookAcceptPause: func(attempt int, delay time.Duration) {
			say("PAUSE %d", attempt)
		},
	}
	loops, err := NewLoops(1)
	if err != nil {
		fmt.Fprintln(os.Stderr, "event loops:", err)
		return 2
	}
	defer loops.Close()
	p.Loops = loops
	served := make(chan error, 1)
	go func() { served <- p.Serve() }()
	say("ADDR %s", ln.Addr())

	var held []*os.File
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		cmd := strings.Fields(in.Text())
		switch {
		case len(cmd) == 2 && cmd[0] == "FILL":
			for {
				f, err := os.Open(os.DevNull)
				if err != nil {
					if !errors.Is(err, syscall.EMFILE) {
						fmt.Fprintln(os.Stderr, "open:", err)
						return 2
					}
					break
				}
				held = append(held, f)
			}
			var n int
			fmt.Sscan(cmd[1], &n)
			for range n {
				held[len(held)-1].Close()
				held = held[:len(held)-1]
			}
			say("FILLED")
		case len(cmd) == 1 && cmd[0] == "RELEASE":
			for _, f := range held {
				f.Close()
			}
			held = nil
			say("RELEASED")
		default:
			fmt.Fprintf(os.Stderr, "unknown command %q\n", in.Text())
			return 2
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), forwardtest.WaitTimeout)
	defer cancel()
	if err := p.Shutdown(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "shutdown:", err)
		return 1
	}
	if err := <-served; err != nil {
		fmt.Fprintln(os.Stderr, "serve:", err)
		return 1
	}
	return 0
}

// TestTCPOutOfFileDescriptors runs a proxy in a child process with a low RLIMIT_NOFILE and
// exhausts its descriptors: a dial that cannot create its socket resets the client, accept
// failing with EMFILE pauses (logging once) until descriptors are freed, and the proxy then
// serves the waiting client. The child must not panic.
func TestTCPOutOfFileDescriptors(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), childEnv+"=emfile", backendEnv+"="+backend.String())
	child := forwardtest.StartChild(t, cmd)
	stdin, stderr := child.Stdin, &child.Stderr
	lines := make(chan string, 100)
	go func() {
		defer close(lines)
		s := bufio.NewScanner(child.Stdout)
		for s.Scan() {
			lines <- s.Text()
		}
	}()
	// expect waits for a line starting with prefix, skipping others.
	expect := func(prefix string) string {
		t.Helper()
		timeout := time.After(forwardtest.WaitTimeout)
		for {
			select {
			case l, ok := <-lines:
				if !ok {
					t.Fatalf("child exited while waiting for %q; stderr:\n%s", prefix, stderr.String())
				}
				if strings.HasPrefix(l, prefix) {
					return l
				}
			case <-timeout:
				t.Fatalf("timed out waiting for %q from the child", prefix)
			}
		}
	}
	send := func(cmd string) {
		t.Helper()
		if _, err := io.WriteString(stdin, cmd+"\n"); err != nil {
			t.Fatal(err)
		}
	}
	proxyAddr, err := netip.ParseAddrPort(strings.TrimPrefix(expect("ADDR "), "ADDR "))
	if err != nil {
		t.Fatal(err)
	}

	// One descriptor left: accept takes it, the dial's socket(2) fails with EMFILE.
	send("FILL 1")
	expect("FILLED")
	// On loopback the proxy's reset may arrive before connect(2) returns: a reset either way.
	if c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(proxyAddr)); err != nil {
		if !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("dial with the proxy out of descriptors for its dial: %v, want ECONNRESET", err)
		}
	} else {
		c.SetDeadline(time.Now().Add(forwardtest.WaitTimeout))
		if _, err := c.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("read with the proxy out of descriptors for its dial: %v, want ECONNRESET", err)
		}
		c.Close()
	}

	// None left: accept fails with EMFILE and pauses; the client waits in the backlog.
	send("FILL 0")
	expect("FILLED")
	c := forwardtest.DialTCP(t, proxyAddr)
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	expect("PAUSE 3") // several retries in one episode
	send("RELEASE")
	expect("RELEASED")
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("after the descriptors were released: %q, %v; want the echo", buf, err)
	}
	c.Close()
	if err := child.Wait(); err != nil {
		t.Fatalf("child: %v; stderr:\n%s", err, stderr.String())
	}

	// The log: one warning per episode, not per retry; the dial failure; the recovery.
	var paused, resumed, dialEMFILE int
	var retries int
	for _, l := range strings.Split(stderr.String(), "\n") {
		if strings.Contains(l, "panic") {
			t.Errorf("child log mentions a panic: %s", l)
		}
		var e struct {
			Level, Message, Error string
			Retries               int
		}
		if json.Unmarshal([]byte(l), &e) != nil {
			continue
		}
		switch {
		case strings.HasPrefix(e.Message, "accept: out of file descriptors"):
			paused++
			if !strings.Contains(e.Error, "too many open files") {
				t.Errorf("pause logged with error %q, want EMFILE", e.Error)
			}
		case e.Message == "accepting connections again":
			resumed++
			retries = e.Retries
		case strings.HasPrefix(e.Message, "cannot create a socket to the endpoint"):
			dialEMFILE++
			if !strings.Contains(e.Error, "too many open files") {
				t.Errorf("dial failure logged with error %q, want EMFILE", e.Error)
			}
		}
	}
	if paused != 1 || resumed != 1 || retries < 3 || dialEMFILE != 1 {
		t.Errorf("log: %d pause warnings, %d resumes after %d retries, %d dial EMFILE warnings; want 1, 1 after ≥3, 1; log:\n%s",
			paused, resumed, retries, dialEMFILE, stderr.String())
	}
}
