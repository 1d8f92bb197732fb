//go:build linux

package udp

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

func TestUDPThaw(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	e1, e2 := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "e1:"), forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "e2:")
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{e1, e2}}
	a := startUDPProxy(t, "4", chooser, nil)
	c1 := forwardtest.DialUDP(t, a.addr)
	if got, err := forwardtest.UDPExchange(c1, []byte("one"), 3, time.Second); err != nil || string(got) != "e1:one" {
		t.Fatalf("before the freeze: %q, %v", got, err)
	}
	st, err := a.Freeze(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := <-a.served; err != nil {
		t.Errorf("Serve of the frozen proxy: %v", err)
	}
	if _, err := c1.Write([]byte("frozen")); err != nil {
		t.Fatal(err)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Thaw(); err != nil {
		t.Fatalf("Thaw: %v", err)
	}
	go func() { a.served <- a.Serve() }()
	buf := make([]byte, 100)
	c1.SetReadDeadline(time.Now().Add(forwardtest.WaitTimeout))
	if n, err := c1.Read(buf); err != nil || string(buf[:n]) != "e1:frozen" {
		t.Errorf("datagram sent while frozen: %q, %v; want e1:frozen (the session's endpoint)", buf[:n], err)
	}
	if got, err := forwardtest.UDPExchange(c1, []byte("again"), 3, time.Second); err != nil || string(got) != "e1:again" {
		t.Errorf("after the thaw: %q, %v; want e1:again", got, err)
	}
	if got, err := forwardtest.UDPExchange(forwardtest.DialUDP(t, a.addr), []byte("new"), 3, time.Second); err != nil || string(got) != "e2:new" {
		t.Errorf("a new session after the thaw: %q, %v; want e2:new", got, err)
	}
}
