//go:build linux

package udp

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// wireUDP is a UDPState on the wire.
type wireUDP struct {
	Conn     int
	Sessions []wireUDPSession
}

type wireUDPSession struct {
	Backend          int
	Client, Endpoint netip.AddrPort
	ReplyFrom        netip.Addr
	Idle             time.Duration
	Refused          bool
}

// sendUDPState sends st, giving up its files.
func sendUDPState(c *net.UnixConn, st forward.UDPState) error {
	var files forwardtest.Files
	w := wireUDP{Conn: files.Add(st.Conn)}
	for _, ss := range st.Sessions {
		w.Sessions = append(w.Sessions, wireUDPSession{Backend: files.Add(ss.Backend), Client: ss.Client,
			Endpoint: ss.Endpoint, ReplyFrom: ss.ReplyFrom, Idle: ss.Idle, Refused: ss.Refused})
	}
	return forwardtest.SendWire(c, w, files)
}

func recvUDPState(c *net.UnixConn) (forward.UDPState, error) {
	var w wireUDP
	files, err := forwardtest.RecvWire(c, &w)
	if err != nil {
		return forward.UDPState{}, err
	}
	st := forward.UDPState{Conn: files.Get(w.Conn)}
	for _, ws := range w.Sessions {
		st.Sessions = append(st.Sessions, forward.UDPSessionState{Backend: files.Get(ws.Backend), Client: ws.Client,
			Endpoint: ws.Endpoint, ReplyFrom: ws.ReplyFrom, Idle: ws.Idle, Refused: ws.Refused})
	}
	return st, nil
}

// passUDPState carries st across a Unix socket pair, as to another process.
func passUDPState(t testing.TB, st forward.UDPState) forward.UDPState {
	t.Helper()
	a, b := forwardtest.SocketPair(t)
	errc := make(chan error, 1)
	go func() { errc <- sendUDPState(a, st) }()
	got, err := recvUDPState(b)
	if err != nil {
		t.Fatalf("receive UDP state: %v", err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("send UDP state: %v", err)
	}
	return got
}
