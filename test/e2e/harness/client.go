//go:build linux

package harness

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// DefaultRequestTimeout bounds one request when the context has no earlier deadline.
const DefaultRequestTimeout = 3 * time.Second

// Answer is what a kup-echo backend answered to one request.
type Answer struct {
	// Backend is the name the backend was started with (see [StartEcho]).
	Backend string
	// Peer is the client address the backend saw.
	Peer netip.AddrPort
}

// Kind classifies how a request failed.
type Kind int

// Kinds of failure.
const (
	// Other is any failure not listed below.
	Other Kind = iota
	// Refused: the connection or datagram was refused (TCP RST to the SYN, or ICMP port
	// unreachable on a connected UDP socket): ECONNREFUSED.
	Refused
	// Reset: an established connection was reset (ECONNRESET, EPIPE).
	Reset
	// Timeout: no answer before the deadline.
	Timeout
	// Closed: the connection was closed cleanly (EOF) before an answer arrived.
	Closed
	// Unreachable: no route, or ICMP host/network unreachable (EHOSTUNREACH, ENETUNREACH).
	Unreachable
	// Denied: a local firewall rule refused the send (EPERM, EACCES), as a REJECT in OUTPUT
	// does for the node's own UDP sockets.
	Denied
)

func (k Kind) String() string {
	switch k {
	case Refused:
		return "refused"
	case Reset:
		return "reset"
	case Timeout:
		return "timeout"
	case Closed:
		return "closed"
	case Unreachable:
		return "unreachable"
	case Denied:
		return "denied"
	}
	return "other"
}

// RequestError is how [Ask] fails.
type RequestError struct {
	Kind    Kind
	Network string
	Addr    string
	From    string // the namespace
	Elapsed time.Duration
	Err     error
}

func (e *RequestError) Error() string {
	return fmt.Sprintf("%s request to %s from %s: %s after %v: %v", e.Network, e.Addr, e.From, e.Kind, e.Elapsed.Round(time.Millisecond), e.Err)
}

func (e *RequestError) Unwrap() error { return e.Err }

// KindOf returns the Kind of a failure returned by Ask (Other for any other error, and for nil).
func KindOf(err error) Kind {
	var re *RequestError
	if errors.As(err, &re) {
		return re.Kind
	}
	return Other
}

// classify maps a socket error to a Kind.
func classify(err error) Kind {
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return Refused
	case errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return Reset
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return Unreachable
	case errors.Is(err, syscall.EPERM), errors.Is(err, syscall.EACCES):
		return Denied
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return Closed
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return Timeout
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return Timeout
	}
	return Other
}

// Ask sends one request from a new socket inside ns to addr ("IP:port") over network ("tcp" or
// "udp": one connection, or one connected UDP socket) and returns the answer of the kup-echo
// backend that got it. A failure is a *RequestError (see [KindOf]). The request gives up at ctx's
// deadline or after DefaultRequestTimeout, whichever comes first.
func Ask(ctx context.Context, ns *netns.NS, network, addr string) (Answer, error) {
	return AskTimeout(ctx, ns, network, addr, DefaultRequestTimeout)
}

// AskTimeout is Ask with a given timeout.
func AskTimeout(ctx context.Context, ns *netns.NS, network, addr string, timeout time.Duration) (Answer, error) {
	start := time.Now()
	fail := func(err error) (Answer, error) {
		return Answer{}, &RequestError{Kind: classify(err), Network: network, Addr: addr, From: ns.Name(), Elapsed: time.Since(start), Err: err}
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, err := ns.DialContext(ctx, network, addr)
	if err != nil {
		return fail(err)
	}
	defer conn.Close()
	return askOn(ctx, conn, network, fail)
}

// askOn sends the request on conn and reads the answer (see AskTimeout); fail wraps an error.
func askOn(ctx context.Context, conn net.Conn, network string, fail func(error) (Answer, error)) (Answer, error) {
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	if _, err := io.WriteString(conn, "ping\n"); err != nil {
		return fail(err)
	}
	var line string
	var err error
	if network == "udp" || strings.HasPrefix(network, "udp") {
		buf := make([]byte, 2048)
		n, err := conn.Read(buf)
		if err != nil {
			return fail(err)
		}
		line = string(buf[:n])
	} else {
		line, err = bufio.NewReader(conn).ReadString('\n')
		if err != nil {
			return fail(err)
		}
	}
	f := strings.Fields(line)
	if len(f) < 2 {
		return fail(fmt.Errorf("malformed answer %q", line))
	}
	peer, err := netip.ParseAddrPort(f[1])
	if err != nil {
		return fail(fmt.Errorf("malformed peer in answer %q: %w", line, err))
	}
	return Answer{Backend: f[0], Peer: netip.AddrPortFrom(peer.Addr().Unmap(), peer.Port())}, nil
}

// BackendsHoldingPorts is Backends whose sockets stay open until the test ends, so that no later
// socket of the test gets the source port of one of them: a proxy's UDP session outlives the
// ClientIP affinity timeout, and a new UDP socket that got an old one's port would be answered
// on that session's endpoint whatever the affinity says.
func BackendsHoldingPorts(t testing.TB, ctx context.Context, ns *netns.NS, network, addr string, n int) (map[string]int, error) {
	seen := map[string]int{}
	for range n {
		start := time.Now()
		fail := func(err error) (Answer, error) {
			return Answer{}, &RequestError{Kind: classify(err), Network: network, Addr: addr, From: ns.Name(), Elapsed: time.Since(start), Err: err}
		}
		actx, cancel := context.WithTimeout(ctx, DefaultRequestTimeout)
		conn, err := ns.DialContext(actx, network, addr)
		if err != nil {
			cancel()
			_, err = fail(err)
			return seen, err
		}
		t.Cleanup(func() { conn.Close() })
		a, err := askOn(actx, conn, network, fail)
		cancel()
		if err != nil {
			return seen, err
		}
		seen[a.Backend]++
	}
	return seen, nil
}

// Backends sends n requests (each on a new socket) and counts the answers per backend; it stops
// at the first failure and returns the counts so far with it.
func Backends(ctx context.Context, ns *netns.NS, network, addr string, n int) (map[string]int, error) {
	seen := map[string]int{}
	for range n {
		a, err := Ask(ctx, ns, network, addr)
		if err != nil {
			return seen, err
		}
		seen[a.Backend]++
	}
	return seen, nil
}
