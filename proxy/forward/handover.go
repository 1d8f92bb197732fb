package forward

import (
	"errors"
	"net/netip"
	"os"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/runstate"
)

// Hand-over (restarts and upgrades that drop nothing): a running proxy can be frozen and its
// sockets taken over by a fresh proxy, in this process or another one.
//
// Freeze stops the proxy at a safe point and exports, as plain data and duplicated descriptors,
// its listening socket and every connection (UDP: session), together with the bytes it had read
// from one socket but not yet written to the other. The frozen proxy serves nothing;
// it keeps its own descriptors until Release closes them, which touches no socket: the
// duplicates keep every socket, its queues and its backlog alive. Adopt, on a fresh proxy, turns
// the exported state back into running connections: pending bytes are written first, in order,
// half-closed directions stay half-closed, and relaying goes on. When a hand-over to another
// process fails, the old process adopts its own exported state into fresh proxies the same way.
//
// The descriptors cross a process boundary as the caller sees fit (SCM_RIGHTS over a Unix
// socket); everything else in TCPState and UDPState is plain data.
//
// A TCP connection is frozen in a turn of its event loop, where nothing is half done. A UDP
// proxy's goroutines are stopped by deadlines in the past on the frozen proxy's own descriptors
// (a deadline belongs to the Go runtime's view of a descriptor, not to the socket, so the
// duplicates are unaffected) and a frozen flag checked when one wakes up: the relay pays nothing
// per datagram.

// ErrClosed is returned (wrapped) by Freeze and Adopt on a proxy that was closed or released.
var ErrClosed = runstate.ErrClosed

// ErrFrozen is returned (wrapped) by Freeze and Adopt on a proxy that was frozen before.
var ErrFrozen = runstate.ErrFrozen

// ErrNotSupported is returned (wrapped), on systems other than Linux, for what needs Linux: the
// hand-over (Freeze, Adopt, the sockets from files).
var ErrNotSupported = errors.New("not supported on this OS")

// TCPState is a frozen TCPProxy: its listening socket and its established connections. Its
// files belong to whoever holds the state: Adopt and TCPListenerFromFile take them over, Close
// closes them.
type TCPState struct {
	// Listener is a duplicate of the listening socket, still listening: connections that
	// arrive meanwhile wait in its backlog. Nil when the proxy had no Listener.
	Listener *os.File
	// Conns are the connections, in no particular order.
	Conns []TCPConnState
}

// TCPConnState is one frozen TCP connection.
type TCPConnState struct {
	// Client and Backend are duplicates of the connection's two sockets. Backend is nil for a
	// connection frozen before it reached an endpoint (Freeze's ctx ended while it was
	// dialling): the adopter dials it, as if it had just been accepted, so its PROXY protocol
	// header, if any, is sent once, by the adopter.
	Client, Backend *os.File
	// ClientAddr is the client's address (unmapped); Endpoint the connected endpoint (zero
	// when Backend is nil). For logs: the sockets carry the truth.
	ClientAddr, Endpoint netip.AddrPort
	// ToEndpoint and ToClient are bytes read from one socket and not yet written to the other.
	// The adopter writes them first.
	ToEndpoint, ToClient []byte
	// ToEndpointDone: the client sent EOF and the endpoint's side was already half-closed
	// (CloseWrite done); ToEndpoint is then empty and the adopter copies nothing that way.
	// ToClientDone likewise for the other direction.
	ToEndpointDone, ToClientDone bool
}

// Close closes every file of the state (for a state nobody adopts) and returns the first error.
func (s TCPState) Close() error {
	errs := []error{closeFile(s.Listener)}
	for _, c := range s.Conns {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}

// Close closes the connection's files (for a connection nobody adopts) and returns the first
// error.
func (c TCPConnState) Close() error {
	return errors.Join(closeFile(c.Client), closeFile(c.Backend))
}

func closeFile(f *os.File) error {
	if f == nil {
		return nil
	}
	return f.Close()
}

// HandoverMetrics is implemented by a Metrics that wants to hear of hand-overs. Release calls
// ConnReleased for each connection and UDPSessionReleased for each session it gave up: they end
// in this proxy without ConnClosed or UDPSessionClosed, because they go on elsewhere. (Adopt
// reports an adopted connection with ConnAccepted and a session with UDPSessionOpened, so a
// process that adopts its own state and wants a true gauge counts the releases down.)
type HandoverMetrics interface {
	ConnReleased()
	UDPSessionReleased()
}
