package userspace

import (
	"bufio"
	"fmt"
	"net"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

func TestLimitsPerPort(t *testing.T) {
	for _, tc := range []struct {
		name     string
		lim      Limits
		conns    int // MaxConnsPerPort resolved (2 descriptors each)
		sessions int
		dataPath int
	}{
		{name: "no file limit: no bounds", lim: Limits{}, conns: 0, sessions: 0, dataPath: 0},
		{name: "1024: a quarter reserved, half of the rest per port", lim: Limits{FileLimit: 1024}, conns: 192, sessions: 384, dataPath: 768},
		{name: "64000: 256 reserved", lim: Limits{FileLimit: 64000}, conns: 15936, sessions: 31872, dataPath: 63744},
		{name: "explicit bounds", lim: Limits{FileLimit: 1024, MaxConnsPerPort: 10, MaxSessionsPerPort: -1}, conns: 10, sessions: 0, dataPath: 768},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := tc.lim
			if got := l.perPort(l.MaxConnsPerPort, 2); got != tc.conns {
				t.Errorf("connections per port %d, want %d", got, tc.conns)
			}
			if got := l.perPort(l.MaxSessionsPerPort, 1); got != tc.sessions {
				t.Errorf("sessions per port %d, want %d", got, tc.sessions)
			}
			if got := l.dataPathFDs(); got != tc.dataPath {
				t.Errorf("data path descriptors %d, want %d", got, tc.dataPath)
			}
		})
	}
}

// TestProxierAppliesLimits: the proxier's listeners get the per-port bound, and the budget's
// limit leaves out the listeners' own descriptors.
func TestProxierAppliesLimits(t *testing.T) {
	a := startBackend(t, "a")
	p := newTestProxier(t, Options{Limits: Limits{FileLimit: 1024, MaxConnsPerPort: 2}})
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80), udpPort("udp", 53)}))
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-a", "tcp", v1.ProtocolTCP, a))
	p.Sync()
	if got, want := p.Budget().Limit(), 768-3; got != want { // a TCP listener, a UDP one and its conntrack socket
		t.Errorf("budget limit %d, want %d", got, want)
	}
	port := proxyPort(t, p, echoTCP)
	var held []net.Conn
	for i := range 2 {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
		fmt.Fprintf(c, "hi\n")
		if _, err := bufio.NewReader(c).ReadString('\n'); err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
	}
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	if got, err := ask(t, "tcp", port, "third"); err == nil {
		t.Errorf("a third connection was served (%q) beyond MaxConnsPerPort 2", got)
	}
}

// TestListenersBoundedByFileLimit: with more service ports than the file limit leaves
// descriptors for, the proxier opens listeners for the first ones by name, reports the others as
// unservable (their portals reject), keeps the reserve and the data path's floor, and opens the
// rest as soon as ports are deleted.
func TestListenersBoundedByFileLimit(t *testing.T) {
	a := startBackend(t, "a")
	// 300 - 256 reserved = 44 for the data path; 11 kept for connections: 33 listeners.
	lim := Limits{FileLimit: 300, Reserve: 256}
	if got := lim.listenerFDs(); got != 33 {
		t.Fatalf("listener descriptors %d, want 33", got)
	}
	var unservable []int
	portals := &recordingPortals{}
	p := newTestProxier(t, Options{Limits: lim, Portals: portals, OnSynced: func(r proxy.SyncResult) {
		unservable = append(unservable, r.Unservable)
	}})
	tr := p.Tracker()
	for i := range 40 {
		name := fmt.Sprintf("s%02d", i)
		tr.OnServiceUpdate(nil, service(name, []v1.ServicePort{tcpPort("tcp", 80)}))
		tr.OnEndpointSliceUpdate(nil, slice(name, name+"-a", "tcp", v1.ProtocolTCP, a))
	}
	p.Sync()
	check := func(wantOpen int) {
		t.Helper()
		open := 0
		for i, st := range p.Ports() {
			isOpen := st.ProxyPort != 0
			if isOpen != (i < wantOpen) {
				t.Errorf("%s: open %v, want %v", st.ServicePort, isOpen, i < wantOpen)
			}
			if !isOpen && (st.Internal != proxy.Reject || st.External != proxy.Reject) {
				t.Errorf("%s: no listener, but its portals %v/%v", st.ServicePort, st.Internal, st.External)
			}
			if isOpen {
				open++
			}
		}
		if open != wantOpen {
			t.Errorf("%d listeners open, want %d", open, wantOpen)
		}
		if got, want := p.Budget().Limit(), 44-open; got != want {
			t.Errorf("data path budget %d, want %d", got, want)
		}
	}
	check(33)
	if got := unservable[len(unservable)-1]; got != 7 {
		t.Errorf("unservable %d, want 7", got)
	}
	if got := mustAsk(t, "tcp", proxyPort(t, p, proxy.Name{Namespace: "default", Name: "s00", Port: "tcp"})); got == "" {
		t.Error("s00 does not answer")
	}
	for i := range 7 {
		name := fmt.Sprintf("s%02d", i)
		tr.OnServiceUpdate(service(name, []v1.ServicePort{tcpPort("tcp", 80)}), nil)
	}
	p.Sync()
	check(33)
	if got := unservable[len(unservable)-1]; got != 0 {
		t.Errorf("unservable %d after deleting 7, want 0", got)
	}
}
