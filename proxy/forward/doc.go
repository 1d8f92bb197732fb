// Package forward is what the proxy's data path shares and what its users name: given the
// listening socket of one service port, the TCP proxy (package proxy/forward/tcp) or the UDP
// proxy (package proxy/forward/udp) forwards every connection or flow to an endpoint picked by
// a Chooser. It knows nothing about Kubernetes objects or iptables; the proxier creates the
// listening sockets, hands each one to a tcp.Proxy or a udp.Proxy and runs its Serve method in
// a goroutine it owns.
//
// Here: the Chooser and the Target it answers with (OriginalDstChooser to skip the original
// destination), the Metrics both engines report to (HandoverMetrics for hand-overs), the
// LogScope of their log lines, the descriptor Budget every port shares (RaiseFileLimit sizes
// it), and the hand-over's records (TCPState, UDPState: plain data and descriptors, handover.go)
// with its errors (ErrClosed, ErrFrozen, ErrNotSupported).
//
// Below it: tcp and udp (the engines, each with its Linux engine and a portable relay for other
// systems, behind one connection policy), proxyproto (the PROXY protocol header) and, internal
// to the data path, sys (raw system calls, socket addresses, SO_ORIGINAL_DST, transparent
// dialing), ctnetlink (the original destination of a UDP flow), runstate (the
// Serve/Close/freeze life cycle), backpressure (pausing on EMFILE), logscope (scoped log
// events) and forwardtest (what the tests share).
package forward
