//go:build linux

package tcp

import (
	"net"
	"net/netip"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// The tests hand states over as another process would: only the files (through a Unix socket,
// with SCM_RIGHTS) and the plain fields (as JSON) cross.

// wireTCP is a TCPState on the wire: files are indices into the descriptors sent with it (-1:
// none).
type wireTCP struct {
	Listener int
	Conns    []wireTCPConn
}

type wireTCPConn struct {
	Client, Backend              int
	ClientAddr, Endpoint         netip.AddrPort
	ToEndpoint, ToClient         []byte
	ToEndpointDone, ToClientDone bool
}

// sendTCPState sends st, giving up its files.
func sendTCPState(c *net.UnixConn, st forward.TCPState) error {
	var files forwardtest.Files
	w := wireTCP{Listener: files.Add(st.Listener)}
	for _, cs := range st.Conns {
		w.Conns = append(w.Conns, wireTCPConn{Client: files.Add(cs.Client), Backend: files.Add(cs.Backend),
			ClientAddr: cs.ClientAddr, Endpoint: cs.Endpoint, ToEndpoint: cs.ToEndpoint, ToClient: cs.ToClient,
			ToEndpointDone: cs.ToEndpointDone, ToClientDone: cs.ToClientDone})
	}
	return forwardtest.SendWire(c, w, files)
}

func recvTCPState(c *net.UnixConn) (forward.TCPState, error) {
	var w wireTCP
	files, err := forwardtest.RecvWire(c, &w)
	if err != nil {
		return forward.TCPState{}, err
	}
	st := forward.TCPState{Listener: files.Get(w.Listener)}
	for _, wc := range w.Conns {
		st.Conns = append(st.Conns, forward.TCPConnState{Client: files.Get(wc.Client), Backend: files.Get(wc.Backend),
			ClientAddr: wc.ClientAddr, Endpoint: wc.Endpoint, ToEndpoint: wc.ToEndpoint, ToClient: wc.ToClient,
			ToEndpointDone: wc.ToEndpointDone, ToClientDone: wc.ToClientDone})
	}
	return st, nil
}

// passTCPState carries st across a Unix socket pair, as to another process.
func passTCPState(t testing.TB, st forward.TCPState) forward.TCPState {
	t.Helper()
	a, b := forwardtest.SocketPair(t)
	errc := make(chan error, 1)
	go func() { errc <- sendTCPState(a, st) }()
	got, err := recvTCPState(b)
	if err != nil {
		t.Fatalf("receive TCP state: %v", err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("send TCP state: %v", err)
	}
	return got
}
