// Package forward is the proxy's data path: given the listening socket of one service port, it
// forwards every TCP connection (TCPProxy) or UDP flow (UDPProxy) to an endpoint picked by a
// Chooser. It knows nothing about Kubernetes objects or iptables; the proxier creates the
// listening sockets, hands each one to a TCPProxy or UDPProxy and runs its Serve method in a
// goroutine it owns.
//
// TCP (TCPProxy, on Loops; loop_linux.go): a few event loops (one per processor), each a
// goroutine waiting in Go's poller for its epoll descriptor, serve every listener and
// connection. A proxy's listener is on two of them, each accepting for itself, and a connection
// lives on the loop that accepted it: ~0.3 KiB of state indexed by descriptor, no goroutine of
// its own. Accepting never waits on a dial: the endpoint is dialled with a non-blocking connect
// (retrying other endpoints with growing timeouts), and a client that reaches no endpoint is
// reset. A direction copies through the loop's buffer until a read fills it, then with splice(2)
// through a pipe held only while data flows (HAProxy's splice-auto; pipe_linux.go), so bulk
// bytes never enter user space and an idle connection costs its two sockets. Half-closes are
// passed on; timeouts are checked by a coarse sweep rather than a timer per connection. The
// client side's TCP keepalive and TCP_NODELAY are inherited from the listening socket
// (ListenTCP), so accepting sets no options. Running out of file descriptors on accept pauses
// accepting with a growing sleep instead of failing.
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
// Both engines follow one connection policy (policy.go): admission within MaxConns and the
// Budget, Choose, failover from one dial attempt to the next with DialTimeouts and the same log
// lines, the PROXY protocol header, the end's metrics.
//
// Hand-over (handover_linux.go, handover_udp_linux.go): Freeze stops a proxy at a safe point and exports
// its listening socket and every connection or session as plain data plus duplicated
// descriptors, including the bytes a connection had read but not yet written (its pending
// buffer's, or drained from its splice pipe); Adopt, on a fresh proxy of this process or another, carries on
// from there, and Release lets the frozen proxy close its own descriptors without touching the
// sockets.
//
// The engines above are Linux's (_linux files: epoll, splice, recvmmsg, SO_ORIGINAL_DST,
// ctnetlink). On other systems (relay_other.go) TCPProxy and UDPProxy serve with the portable
// relay (relay_tcp.go, relay_udp.go; its tests run on Linux too): goroutines with net.Conn,
// io.Copy each way with half-close, one datagram per call, no original destination, no
// transparent dialing, and Freeze and Adopt fail with ErrNotSupported.
package forward
