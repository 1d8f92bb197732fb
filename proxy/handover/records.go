package handover

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
)

// The records of a hand-over, of this protocol Version: their kinds, what each one's meta
// says, and its descriptors. A change here is a change of Version (see docs/handover.md).
//
// The connection and session records are the data path's frozen state (forward.TCPConnState,
// forward.UDPSessionState) as it travels: their wire types below have the same fields, in the
// same order, and convert to and from the data path's types, so a field added to one and not
// to the other does not compile. Their files travel as the record's descriptors (json:"-").
const (
	// KindListener: a proxy port's listening socket (one descriptor); meta ListenerMeta.
	// It comes before the connections and sessions of its listener.
	KindListener = "listener"
	// KindTCPConn: an established TCP connection (two descriptors: client, endpoint) or one
	// frozen while dialling (one: the client's); meta TCPConnMeta.
	KindTCPConn = "tcp-conn"
	// KindUDPSession: a UDP session (one descriptor: its socket connected to the endpoint);
	// meta UDPSessionMeta.
	KindUDPSession = "udp-session"
	// KindHeld: a held NodePort or local portal IP:port (one descriptor); meta HeldMeta.
	KindHeld = "held-port"
	// KindAffinity: one service port's ClientIP affinity entries (no descriptor); meta
	// []loadbalancer.AffinityEntry.
	KindAffinity = "affinity"
	// KindServer: an HTTP server's listening socket (one descriptor); meta the server's name,
	// a string ("healthz", "metrics", "healthcheck <network> <address>").
	KindServer = "server"
	// KindFlowTargets: what the portals did with each UDP target (no descriptor); meta
	// portal.FlowTargets.
	KindFlowTargets = "flow-targets"
)

// ListenerMeta is a KindListener record's meta.
type ListenerMeta struct {
	Name      proxy.Name  `json:"name"`
	Protocol  v1.Protocol `json:"protocol"`
	ProxyPort int         `json:"proxyPort"`
}

// HeldMeta is a KindHeld record's meta.
type HeldMeta struct {
	Protocol v1.Protocol `json:"protocol"`
	Addr     netip.Addr  `json:"addr"`
	Port     int         `json:"port"`
}

// TCPConnMeta is a KindTCPConn record's meta: the service port and the connection. A
// connection frozen before its endpoint answered has no endpoint, nothing in flight, and
// travels with its client socket alone: the adopter dials it as if it had just accepted it.
type TCPConnMeta struct {
	Name proxy.Name `json:"name"`
	tcpConnWire
}

// tcpConnWire is forward.TCPConnState on the wire.
type tcpConnWire struct {
	Client         *os.File       `json:"-"`
	Backend        *os.File       `json:"-"`
	ClientAddr     netip.AddrPort `json:"client"`
	Endpoint       netip.AddrPort `json:"endpoint"`
	ToEndpoint     []byte         `json:"toEndpoint,omitempty"`
	ToClient       []byte         `json:"toClient,omitempty"`
	ToEndpointDone bool           `json:"toEndpointDone,omitempty"`
	ToClientDone   bool           `json:"toClientDone,omitempty"`
}

// UDPSessionMeta is a KindUDPSession record's meta.
type UDPSessionMeta struct {
	Name proxy.Name `json:"name"`
	udpSessionWire
}

// udpSessionWire is forward.UDPSessionState on the wire.
type udpSessionWire struct {
	Backend   *os.File       `json:"-"`
	Client    netip.AddrPort `json:"client"`
	Endpoint  netip.AddrPort `json:"endpoint"`
	ReplyFrom netip.Addr     `json:"replyFrom,omitzero"`
	Idle      time.Duration  `json:"idle"`
	Refused   bool           `json:"refused,omitempty"`
}

// TCPConnRecord returns the record of a frozen connection of the service port name; it owns
// the connection's files from then on (on error they are closed).
func TCPConnRecord(name proxy.Name, cs forward.TCPConnState) (Record, error) {
	files := []*os.File{cs.Client}
	if cs.Backend != nil {
		files = append(files, cs.Backend)
	}
	w := tcpConnWire(cs)
	w.Client, w.Backend = nil, nil
	r, err := NewRecord(KindTCPConn, TCPConnMeta{Name: name, tcpConnWire: w}, files...)
	if err != nil {
		closeFiles(files)
	}
	return r, err
}

// TCPConn decodes a KindTCPConn record: its service port and the connection, whose files
// are the record's (the caller takes them: set r.Files to nil).
func (r *Record) TCPConn() (proxy.Name, forward.TCPConnState, error) {
	var m TCPConnMeta
	if err := r.decode(&m, 1, 2); err != nil {
		return proxy.Name{}, forward.TCPConnState{}, err
	}
	cs := forward.TCPConnState(m.tcpConnWire)
	cs.Client = r.Files[0]
	if len(r.Files) == 2 {
		cs.Backend = r.Files[1]
	} else if len(cs.ToEndpoint)+len(cs.ToClient) > 0 || cs.ToEndpointDone || cs.ToClientDone {
		return proxy.Name{}, forward.TCPConnState{}, fmt.Errorf("connection of %s from %s: bytes in flight without an endpoint socket", m.Name, cs.ClientAddr)
	}
	return m.Name, cs, nil
}

// UDPSessionRecord returns the record of a frozen session of the service port name; it owns
// the session's file from then on (on error it is closed).
func UDPSessionRecord(name proxy.Name, s forward.UDPSessionState) (Record, error) {
	w := udpSessionWire(s)
	w.Backend = nil
	r, err := NewRecord(KindUDPSession, UDPSessionMeta{Name: name, udpSessionWire: w}, s.Backend)
	if err != nil && s.Backend != nil {
		_ = s.Backend.Close()
	}
	return r, err
}

// UDPSession decodes a KindUDPSession record: its service port and the session, whose file
// is the record's (the caller takes it: set r.Files to nil).
func (r *Record) UDPSession() (proxy.Name, forward.UDPSessionState, error) {
	var m UDPSessionMeta
	if err := r.decode(&m, 1, 1); err != nil {
		return proxy.Name{}, forward.UDPSessionState{}, err
	}
	s := forward.UDPSessionState(m.udpSessionWire)
	s.Backend = r.Files[0]
	return m.Name, s, nil
}

// Decode decodes the record's meta into v, checking it carries between min and max
// descriptors.
func (r *Record) Decode(v any, min, max int) error { return r.decode(v, min, max) }

func (r *Record) decode(v any, min, max int) error {
	if n := len(r.Files); n < min || n > max {
		if min == max {
			return fmt.Errorf("%s record: %d descriptors, want %d", r.Kind, n, min)
		}
		return fmt.Errorf("%s record: %d descriptors, want %d to %d", r.Kind, n, min, max)
	}
	if err := json.Unmarshal(r.Meta, v); err != nil {
		return fmt.Errorf("decode %s record: %w", r.Kind, err)
	}
	return nil
}
