// Package tcp is the TCP data path of a service port: a Proxy forwards every connection accepted
// on the port's listening socket to an endpoint picked by a forward.Chooser.
//
// A few event loops (Loops, one per processor; loop_linux.go), each a goroutine waiting in Go's
// poller for its epoll descriptor, serve every listener and connection. A proxy's listener is on
// two of them, each accepting for itself, and a connection lives on the loop that accepted it:
// ~0.3 KiB of state indexed by descriptor, no goroutine of its own. Accepting never waits on a
// dial: the endpoint is dialled with a non-blocking connect (retrying other endpoints with
// growing timeouts), and a client that reaches no endpoint is reset. A direction copies through
// the loop's buffer until a read fills it, then with splice(2) through a pipe held only while
// data flows (HAProxy's splice-auto; pipe_linux.go; idle pipes are pooled in the
// forward.Budget), so bulk bytes never enter user space and an idle connection costs its two
// sockets. Half-closes are passed on; timeouts are checked by a coarse sweep rather than a timer
// per connection. The client side's TCP keepalive and TCP_NODELAY are inherited from the
// listening socket (Listen; keepalive_linux.go), so accepting sets no options. Running out of
// file descriptors on accept pauses accepting with a growing sleep instead of failing.
//
// The proxy reports the original destination of a connection (before the portal's
// REDIRECT/DNAT) to the Chooser, read from conntrack with getsockopt SO_ORIGINAL_DST (skipped
// when the Chooser says it does not need it: forward.OriginalDstChooser), and sends the PROXY
// protocol header a Target asks for (package proxyproto).
//
// Both engines follow one connection policy (policy.go): admission within MaxConns and the
// Budget, Choose, failover from one dial attempt to the next with DialTimeouts and the same log
// lines, the PROXY protocol header, the end's metrics.
//
// Hand-over (handover_linux.go, loop_proxy_linux.go): Freeze stops a proxy at a safe point and
// exports its listening socket and every connection as a forward.TCPState: plain data plus
// duplicated descriptors, including the bytes a connection had read but not yet written (its
// pending buffer's, or drained from its splice pipe); Adopt, on a fresh proxy of this process or
// another, carries on from there (ListenerFromFile serves the listener again), and Release lets
// the frozen proxy close its own descriptors without touching the sockets.
//
// The event loops are Linux's (_linux files: epoll, splice, SO_ORIGINAL_DST). On other systems
// (relay_other.go) a Proxy serves with the portable relay (relay.go; its tests run on Linux
// too): goroutines with net.Conn, io.Copy each way with half-close, no original destination, no
// transparent dialing, and Freeze and Adopt fail with forward.ErrNotSupported.
package tcp
