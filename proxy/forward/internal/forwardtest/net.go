package forwardtest

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
)

// Loopback returns the Loopback address of the family ("4" or "6").
func Loopback(family string) netip.Addr {
	if family == "6" {
		return netip.IPv6Loopback()
	}
	return netip.MustParseAddr("127.0.0.1")
}

// ListenTCP listens on an ephemeral port of addr.
func ListenTCP(t testing.TB, addr netip.Addr) *net.TCPListener {
	t.Helper()
	ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(netip.AddrPortFrom(addr, 0)))
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	return ln
}

func ListenerAddr(ln *net.TCPListener) netip.AddrPort {
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// tcpServer runs handle on every connection accepted on a loopback listener until the test
// ends.
type tcpServer struct {
	ln    *net.TCPListener
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[*net.TCPConn]struct{}
}

func StartTCPServer(t testing.TB, addr netip.Addr, handle func(*net.TCPConn)) netip.AddrPort {
	t.Helper()
	s := &tcpServer{ln: ListenTCP(t, addr), conns: map[*net.TCPConn]struct{}{}}
	s.wg.Add(1)
	go s.acceptTestConns(handle)
	t.Cleanup(func() {
		s.ln.Close()
		s.mu.Lock()
		for c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return ListenerAddr(s.ln)
}

func (s *tcpServer) acceptTestConns(handle func(*net.TCPConn)) {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptTCP()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns[c] = struct{}{}
		s.mu.Unlock()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			handle(c)
			c.Close()
			s.mu.Lock()
			delete(s.conns, c)
			s.mu.Unlock()
		}()
	}
}

// EchoTCP echoes until EOF, then half-closes.
func EchoTCP(c *net.TCPConn) {
	if _, err := io.Copy(c, c); err == nil {
		c.CloseWrite()
	}
}

func StartTCPEcho(t testing.TB, addr netip.Addr) netip.AddrPort {
	return StartTCPServer(t, addr, EchoTCP)
}

func DialTCP(t testing.TB, ap netip.AddrPort) *net.TCPConn {
	t.Helper()
	c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(ap))
	if err != nil {
		t.Fatalf("dial %s: %v", ap, err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(WaitTimeout))
	return c
}

// RoundTrip writes msg and reads as many bytes back.
func RoundTrip(c net.Conn, msg []byte) ([]byte, error) {
	if _, err := c.Write(msg); err != nil {
		return nil, err
	}
	got := make([]byte, len(msg))
	_, err := io.ReadFull(c, got)
	return got, err
}

// udpEcho answers every datagram with prefix followed by the datagram, until the test ends.
func StartUDPEcho(t testing.TB, addr netip.Addr, prefix string) netip.AddrPort {
	t.Helper()
	conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(addr, 0)))
	if err != nil {
		t.Fatalf("listen UDP: %v", err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 1<<16)
		for {
			n, from, err := conn.ReadFromUDPAddrPort(buf[len(prefix):])
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				continue
			}
			copy(buf, prefix)
			conn.WriteToUDPAddrPort(buf[:len(prefix)+n], from)
		}
	}()
	t.Cleanup(func() {
		conn.Close()
		<-done
	})
	return conn.LocalAddr().(*net.UDPAddr).AddrPort()
}

// DialUDP returns a UDP socket connected to ap.
func DialUDP(t testing.TB, ap netip.AddrPort) *net.UDPConn {
	t.Helper()
	c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(ap))
	if err != nil {
		t.Fatalf("dial UDP %s: %v", ap, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// UDPExchange sends msg and returns the first reply, retrying a few times as a UDP client
// does (the first datagrams of a flow may be lost to a refused endpoint).
func UDPExchange(c *net.UDPConn, msg []byte, tries int, perTry time.Duration) ([]byte, error) {
	buf := make([]byte, 1<<16)
	var err error
	for range tries {
		if _, err = c.Write(msg); err != nil {
			return nil, err
		}
		c.SetReadDeadline(time.Now().Add(perTry))
		var n int
		n, err = c.Read(buf)
		if err == nil {
			return buf[:n], nil
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, err
		}
	}
	return nil, err
}

// ResetConn closes conn with an RST instead of a FIN (SO_LINGER with a zero timeout), dropping
// unsent data.
func ResetConn(conn *net.TCPConn) {
	_ = conn.SetLinger(0)
	_ = conn.Close()
}

// TCPAddrPort returns the address of a TCP socket end, or the zero AddrPort.
func TCPAddrPort(a net.Addr) netip.AddrPort {
	if ta, ok := a.(*net.TCPAddr); ok {
		return sys.UnmapAddrPort(ta.AddrPort())
	}
	return netip.AddrPort{}
}
