// Package forward is the proxy's data path: given the listening socket of one service port, it
// forwards every TCP connection (TCPProxy) or UDP flow (UDPProxy) to an endpoint picked by a
// Chooser. It knows nothing about Kubernetes objects or iptables; the proxier creates the
// listening sockets, hands each one to a TCPProxy or UDPProxy and runs its Serve method in a
// goroutine it owns.
//
// TCP: the accept loop never waits on a dial. Each accepted connection gets its own goroutine,
// which dials the chosen endpoint (retrying other endpoints with growing timeouts) and resets
// the client when no endpoint can be reached; then one fresh goroutine per direction copies and
// propagates half-closes. A direction copies through a small pooled buffer (read and write) until
// a read fills it, then with splice(2) through a pipe, so that bulk bytes never enter user space
// (HAProxy's splice-auto; the pipe comes from a small per-proxy pool, the buffer from a
// process-wide one, and either is held only while data flows). Under Start, a direction that has
// moved nothing for ParkIdleAfter gives its goroutine up and waits on the Poller, which resumes
// it on a new goroutine (park.go): an idle connection thus costs its two sockets and a few
// hundred bytes of heap per direction, and no goroutine stack; after a burst of parkings the
// Poller has the freed stacks returned to the system (memreturn.go). The client side's TCP
// keepalive and TCP_NODELAY are inherited from the listening socket (ListenTCP), so accepting
// on an event loop sets no options. Running out of file descriptors on accept pauses accepting
// with a growing sleep instead of failing.
//
// TCP on event loops (TCPProxy.Loops, --tcp-data-path=loop; loop_linux.go): the same
// semantics without a goroutine per connection. A proxy's listener is on two of a few loops (one
// per processor), each a goroutine waiting in Go's poller for its epoll descriptor and accepting
// for itself, and a connection lives on the loop that accepted it; a connection is ~0.3 KiB of state indexed by descriptor, dialled with a
// non-blocking connect, relayed through the loop's buffer (splice once a read fills it), and
// timed by a coarse sweep rather than a timer of its own. Freeze, Adopt and Thaw work on it
// too, and a hand-over may cross from one data path to the other.
//
// UDP: one session per client address, each with its own connected socket to the endpoint and
// one goroutine reading the endpoint's replies, which are written back from the service's own
// listening socket, with the source address the client's datagrams arrived at, so that
// conntrack un-NATs them. Sessions end after an idle timeout, when their endpoint leaves the
// service (DropSessions), or when the proxy closes.
//
// Both report the original destination of the traffic (before the portal's REDIRECT/DNAT) to the
// Chooser, read from conntrack: with getsockopt SO_ORIGINAL_DST for TCP (skipped when the
// Chooser says it does not need it: OriginalDstChooser), and with a ctnetlink
// lookup once per new UDP session (UDP has no SO_ORIGINAL_DST, and IP_RECVORIGDSTADDR reports
// the NATed destination, not the original one, except under TPROXY).
//
// Hand-over (handover.go, handover_udp.go): Freeze stops a proxy at a safe point and exports
// its listening socket and every connection or session as plain data plus duplicated
// descriptors, including the bytes a copier had read but not yet written (its buffer's, or
// drained from the splice pipe); Adopt, on a fresh proxy of this process or another, carries on
// from there, and Release lets the frozen proxy close its own descriptors without touching the
// sockets.
//
// The package is Linux-only (splice, SO_ORIGINAL_DST, IP_ORIGDSTADDR).
package forward
