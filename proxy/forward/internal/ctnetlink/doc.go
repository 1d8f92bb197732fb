// Package ctnetlink asks the kernel's connection tracking, over a ctnetlink socket, for the
// original destination of a UDP flow (Conn.OriginalDst): the service address a datagram was
// sent to before the portal's REDIRECT or DNAT. UDP has no SO_ORIGINAL_DST, and
// IP_ORIGDSTADDR reports the address after NAT, so the UDP proxy looks each new session up here
// once. It needs CAP_NET_ADMIN in the socket's network namespace and Linux: elsewhere Conn is an
// empty type and there is no Open.
package ctnetlink
