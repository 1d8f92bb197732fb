//go:build linux

package userspace

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover/handovertest"
)

// The listening sockets a holder keeps outlive the proxier that opened them: a TCP connection
// and a UDP datagram that arrive after it is gone wait in the kernel, and the next proxier,
// adopting the kept sockets, serves them on the same proxy ports. A kept socket of a service
// port the next proxier does not serve is closed by its first sync; garbage is refused.
func TestKeptListenersOutliveTheProxier(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	path := filepath.Join(t.TempDir(), "holder", "holder.sock")
	store, stopStore := handovertest.ServeStore(t, path)
	defer stopStore()
	sc := &handover.StoreClient{Path: path}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	old := newTestProxier(t, Options{})
	feed(old, a, b)
	goneSvc := proxy.Name{Namespace: "default", Name: "gone", Port: "tcp"}
	old.Tracker().OnServiceUpdate(nil, service("gone", []v1.ServicePort{tcpPort("tcp", 80)}))
	old.Sync()
	tcpNo, udpNo, goneNo := proxyPort(t, old, echoTCP), proxyPort(t, old, echoUDP), proxyPort(t, old, goneSvc)
	kept := old.KeptListeners()
	if len(kept) != 3 {
		t.Fatalf("KeptListeners: %d, want 3", len(kept))
	}
	if _, err := sc.Replace(ctx, kept); err != nil {
		t.Fatal(err)
	}

	// The proxier goes away as a killed process does: its sockets close.
	old.closeListeners()
	cctx, ccancel := context.WithCancel(context.Background())
	ccancel()
	_ = old.Shutdown(cctx)

	conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", tcpNo), 2*time.Second)
	if err != nil {
		t.Fatalf("a connection while no proxier runs: %v (want it queued)", err)
	}
	defer conn.Close()
	if _, err := fmt.Fprintf(conn, "queued\n"); err != nil {
		t.Fatal(err)
	}
	udp, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netipLoopback(udpNo)))
	if err != nil {
		t.Fatal(err)
	}
	defer udp.Close()
	if _, err := udp.Write([]byte("queued\n")); err != nil {
		t.Fatal(err)
	}

	info, recs, err := sc.Take(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Count != 3 || len(recs) != 3 {
		t.Fatalf("the holder gave %d records (count %d), want 3", len(recs), info.Count)
	}
	// Garbage beside them: a pipe, a socket bound elsewhere than its record says, a UDP
	// socket named TCP, and a second listener for a service port already given.
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	other, err := net.ListenTCP("tcp", &net.TCPAddr{})
	if err != nil {
		t.Fatal(err)
	}
	otherFile, _ := other.File()
	other.Close()
	udpSock, err := net.ListenUDP("udp", &net.UDPAddr{})
	if err != nil {
		t.Fatal(err)
	}
	udpFile, _ := udpSock.File()
	udpSock.Close()
	bogus := func(name string, proto v1.Protocol, port int, f *os.File) handover.Record {
		rec, err := handover.NewRecord(handover.KindListener, handover.ListenerMeta{
			Name: proxy.Name{Namespace: "default", Name: name, Port: "tcp"}, Protocol: proto, ProxyPort: port}, f)
		if err != nil {
			t.Fatal(err)
		}
		return rec
	}
	dupOf := func(rec handover.Record) *os.File {
		f, err := handover.Dup(rec.Files[0])
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	var echoRec handover.Record
	for _, rec := range recs {
		var m handover.ListenerMeta
		_ = json.Unmarshal(rec.Meta, &m)
		if m.Name == echoTCP {
			echoRec = rec
		}
	}
	recs = append(recs,
		bogus("pipe", v1.ProtocolTCP, 1000, w),
		bogus("elsewhere", v1.ProtocolTCP, tcpNo+1, otherFile),
		bogus("udp-as-tcp", v1.ProtocolTCP, udpFile2Port(t, udpFile), udpFile),
		bogus("echo", v1.ProtocolTCP, tcpNo, dupOf(echoRec)), // echo's tcp port again
	)

	next := newTestProxier(t, Options{})
	feed(next, a, b)
	if got := next.AdoptKept(recs); got != 3 {
		t.Errorf("AdoptKept took %d, want the 3 kept listeners", got)
	}
	for _, rec := range recs {
		if rec.Files != nil {
			t.Errorf("AdoptKept left the files of a %s record", rec.Kind)
		}
	}
	next.Sync()
	if got := proxyPort(t, next, echoTCP); got != tcpNo {
		t.Errorf("TCP proxy port %d, the kept one %d", got, tcpNo)
	}
	if got := proxyPort(t, next, echoUDP); got != udpNo {
		t.Errorf("UDP proxy port %d, the kept one %d", got, udpNo)
	}
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	answer, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || !strings.Contains(answer, "queued") {
		t.Errorf("the connection queued while no proxier ran: %q, %v", answer, err)
	}
	buf := make([]byte, 256)
	_ = udp.SetDeadline(time.Now().Add(5 * time.Second))
	if n, err := udp.Read(buf); err != nil || !strings.Contains(string(buf[:n]), "queued") {
		t.Errorf("the datagram queued while no proxier ran: %q, %v", buf[:n], err)
	}
	// gone's service port is not next's: its kept socket was closed by the first sync (the
	// holder's own copy is dropped when the proxy replaces its set).
	if _, err := sc.Replace(ctx, next.KeptListeners()); err != nil {
		t.Fatal(err)
	}
	if c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", goneNo), time.Second); err == nil {
		c.Close()
		t.Errorf("the kept listener of a service port no longer served still accepts")
	}
	if store.Len() != 2 {
		t.Errorf("the holder keeps %d sockets, want the 2 that next serves", store.Len())
	}
}

// udpFile2Port returns the port a UDP socket's file is bound to.
func udpFile2Port(t *testing.T, f *os.File) int {
	t.Helper()
	f2, err := handover.Dup(f)
	if err != nil {
		t.Fatal(err)
	}
	pc, err := net.FilePacketConn(f2)
	f2.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	return pc.LocalAddr().(*net.UDPAddr).Port
}
