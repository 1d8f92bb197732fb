package forward

import (
	"errors"
	"net/netip"
	"os"
	"time"
)

// UDPState is a frozen UDPProxy: its socket and its sessions (see handover.go). Its files
// belong to whoever holds it: Adopt and UDPConnFromFile take them over, Close closes them.
type UDPState struct {
	// Conn is a duplicate of the service port's socket. Datagrams not yet read wait in its
	// receive buffer, which both holders share. Nil when the proxy had no Conn.
	Conn     *os.File
	Sessions []UDPSessionState
}

// UDPSessionState is one frozen UDP session.
type UDPSessionState struct {
	// Backend is a duplicate of the session's socket, connected to Endpoint. Replies not yet
	// read wait in its receive buffer.
	Backend *os.File
	// Client is the client's address as received on Conn (IPv4-mapped on an AF_INET6
	// socket), which keys the session; Endpoint is the session's endpoint.
	Client, Endpoint netip.AddrPort
	// ReplyFrom is the address replies leave from (the address the client's datagrams arrived
	// at, set with IP_PKTINFO); invalid when unknown.
	ReplyFrom netip.Addr
	// Idle is the time since the session's last datagram either way: the adopter expires it
	// Timeout after that datagram, as the frozen proxy would have.
	Idle time.Duration
	// Refused: the endpoint answered with an ICMP error; the next datagram chooses again.
	Refused bool
}

// Close closes every file of the state (for a state nobody adopts) and returns the first error.
func (s UDPState) Close() error {
	errs := []error{closeFile(s.Conn)}
	for _, ss := range s.Sessions {
		errs = append(errs, closeFile(ss.Backend))
	}
	return errors.Join(errs...)
}
