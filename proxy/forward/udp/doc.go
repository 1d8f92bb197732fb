// Package udp is the UDP data path of a service port: a Proxy forwards the datagrams received on
// the port's socket to endpoints picked by a forward.Chooser, one session per client address.
//
// A session has its own socket connected to the endpoint and one goroutine reading the
// endpoint's replies, which are written back from the service's own socket with the source
// address the client's datagrams arrived at (IP_PKTINFO), so that conntrack un-NATs them.
// Sessions end after an idle timeout (DefaultTimeout), when their endpoint leaves the service
// (DropSessions), or when the proxy closes. The port's socket is read in batches (recvmmsg;
// batch_linux.go), datagrams of one client go to its session in one sendmmsg, and a run of
// equal-size datagrams in one send with UDP segmentation offload where the kernel has it
// (gso_linux.go). A port with no traffic parks its read loop on a Poller (poller_linux.go)
// instead of keeping a goroutine.
//
// The original destination of a new session (before the portal's REDIRECT or DNAT) is looked
// up once in conntrack over ctnetlink (package internal/ctnetlink): UDP has no
// SO_ORIGINAL_DST, and IP_RECVORIGDSTADDR reports the address after NAT.
//
// Both engines follow one session policy (policy.go): Choose, admission within MaxSessions and
// the forward.Budget with the longest-idle session evicted to make room, failover after an ICMP
// error, the same log lines and metrics.
//
// Hand-over (handover_linux.go): Freeze stops the proxy and exports its socket and sessions as a
// forward.UDPState; Adopt, on a fresh Proxy of this process or another, carries on from there.
//
// The engine above is Linux's. On other systems (relay_other.go) a Proxy serves with the
// portable relay (relay.go; its tests run on Linux too): one datagram per call, no original
// destination, no transparent sockets, and Freeze and Adopt fail with forward.ErrNotSupported.
package udp
