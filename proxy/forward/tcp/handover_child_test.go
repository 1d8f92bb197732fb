//go:build linux

package tcp

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// adoptChild is the helper process of TestTCPHandOverToAnotherProcess: it receives a TCPState
// on the Unix socket at descriptor 3, adopts it into a Proxy serving the received listening
// socket (endpoint from backendEnv), prints "ADOPTED <connections>", serves until its stdin
// closes, waits for its connections to end and prints "BYTES <to endpoint> <from endpoint>
// <closed>".
func adoptChild() int {
	fail := func(what string, err error) int {
		fmt.Fprintf(os.Stderr, "%s: %v\n", what, err)
		return 2
	}
	backend, err := netip.ParseAddrPort(os.Getenv(backendEnv))
	if err != nil {
		return fail("backend address", err)
	}
	f := os.NewFile(3, "handover")
	conn, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return fail("hand-over socket", err)
	}
	defer conn.Close()
	st, err := recvTCPState(conn.(*net.UnixConn))
	if err != nil {
		return fail("receive state", err)
	}
	ln, err := ListenerFromFile(st.Listener)
	if err != nil {
		return fail("listener", err)
	}
	loops, err := NewLoops(2)
	if err != nil {
		return fail("event loops", err)
	}
	defer loops.Close()
	m := &forwardtest.Metrics{}
	p := &Proxy{Listener: ln, Chooser: &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, Metrics: m,
		Log: new(zerolog.New(os.Stderr).Level(zerolog.DebugLevel)), Loops: loops}
	if err := p.Adopt(st.Conns); err != nil {
		return fail("adopt", err)
	}
	served := make(chan error, 1)
	go func() { served <- p.Serve() }()
	fmt.Printf("ADOPTED %d\n", len(st.Conns))
	io.Copy(io.Discard, os.Stdin)
	ctx, cancel := context.WithTimeout(context.Background(), forwardtest.WaitTimeout)
	defer cancel()
	if err := p.Shutdown(ctx); err != nil {
		return fail("shutdown", err)
	}
	if err := <-served; err != nil {
		return fail("serve", err)
	}
	s := m.Snapshot()
	fmt.Printf("BYTES %d %d %d\n", s.ToEndpoint, s.FromEndpoint, s.Closed)
	return 0
}

// TestTCPHandOverToAnotherProcess is TestTCPHandOverMidStream with the adopter in a child
// process that receives the descriptors with SCM_RIGHTS.
func TestTCPHandOverToAnotherProcess(t *testing.T) {
	ms := startMidStream(t)
	n, a, ma, backend := ms.n, ms.a, ms.metrics, ms.backend

	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	parent := forwardtest.UnixConnFromFD(t, fds[0])
	childEnd := os.NewFile(uintptr(fds[1]), "handover")
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), childEnv+"=adopt", backendEnv+"="+backend.String())
	cmd.ExtraFiles = []*os.File{childEnd}
	child := forwardtest.StartChild(t, cmd)
	childEnd.Close()
	lines := bufio.NewScanner(child.Stdout)

	st, err := a.Freeze(context.Background())
	if err != nil {
		t.Fatalf("Freeze: %v", err)
	}
	if len(st.Conns) != 1 || len(st.Conns[0].ToEndpoint) == 0 || len(st.Conns[0].ToClient) == 0 {
		t.Errorf("frozen state %+v: want one connection with bytes pending both ways", plainTCPState(st))
	}
	if err := sendTCPState(parent, st); err != nil {
		t.Fatalf("send state: %v", err)
	}
	if !lines.Scan() || lines.Text() != "ADOPTED 1" {
		t.Fatalf("child said %q; stderr:\n%s", lines.Text(), child.Stderr.String())
	}
	a.Release()
	ms.finish(t)
	child.Stdin.Close()
	var to, from int64
	var closed int
	if !lines.Scan() {
		t.Fatalf("child ended without its byte counts; stderr:\n%s", child.Stderr.String())
	}
	if _, err := fmt.Sscanf(lines.Text(), "BYTES %d %d %d", &to, &from, &closed); err != nil {
		t.Fatalf("child said %q: %v", lines.Text(), err)
	}
	if err := child.Wait(); err != nil {
		t.Fatalf("child: %v; stderr:\n%s", err, child.Stderr.String())
	}
	sa := ma.Snapshot()
	if sa.Closed != 0 || sa.Failed != 0 || closed != 1 {
		t.Errorf("A closed %d and failed %d connections, the child closed %d; want 0, 0, 1", sa.Closed, sa.Failed, closed)
	}
	if sa.ToEndpoint+to != n || sa.FromEndpoint+from != n {
		t.Errorf("bytes counted by A and the child: %d to and %d from the endpoint, want %d each", sa.ToEndpoint+to, sa.FromEndpoint+from, n)
	}
	if strings.Contains(child.Stderr.String(), "panic") {
		t.Errorf("child log mentions a panic:\n%s", child.Stderr.String())
	}
}
