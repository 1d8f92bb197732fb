//go:build linux

package udp

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"github.com/rs/zerolog"
)

// benchModes are the paths measured: straight to the backend, and through the proxy.
var benchModes = []struct {
	name    string
	proxied bool
}{{"Direct", false}, {"Proxy", true}}

// startedModes is benchModes and ProxyStarted: the Proxy started on a Poller (Start).
func startedModes() []struct {
	name    string
	proxied bool
} {
	return append(benchModes[:len(benchModes):len(benchModes)], struct {
		name    string
		proxied bool
	}{"ProxyStarted", true})
}

// startedUDPProxy returns the address of a Proxy in front of backend started on a Poller.
func startedUDPProxy(b *testing.B, backend netip.AddrPort) netip.AddrPort {
	poller, err := NewPoller()
	if err != nil {
		b.Fatal(err)
	}
	conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(forwardtest.Loopback("4"), 0)))
	if err != nil {
		b.Fatal(err)
	}
	p := &Proxy{Conn: conn, Chooser: &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, Log: new(zerolog.Nop())}
	if err := p.Start(poller); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		p.Close()
		poller.Close()
	})
	return conn.LocalAddr().(*net.UDPAddr).AddrPort()
}

func udpTarget(b *testing.B, proxied bool, backend netip.AddrPort) netip.AddrPort {
	if !proxied {
		return backend
	}
	return startUDPProxy(b, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.Log = new(zerolog.Nop())
	}).addr
}

// BenchmarkUDPRequestResponse: one client sends a 64-byte datagram and waits for the echo.
// ProxyStarted is Proxy with the Proxy started on a Poller, as the proxier starts it.
func BenchmarkUDPRequestResponse(b *testing.B) {
	for _, mode := range startedModes() {
		b.Run(mode.name, func(b *testing.B) {
			backend := forwardtest.StartUDPEcho(b, forwardtest.Loopback("4"), "")
			var target netip.AddrPort
			if mode.name == "ProxyStarted" {
				target = startedUDPProxy(b, backend)
			} else {
				target = udpTarget(b, mode.proxied, backend)
			}
			c := forwardtest.DialUDP(b, target)
			msg := make([]byte, 64)
			buf := make([]byte, 2048)
			if _, err := forwardtest.UDPExchange(c, msg, 1, forwardtest.WaitTimeout); err != nil { // open the session
				b.Fatal(err)
			}
			c.SetReadDeadline(time.Now().Add(time.Hour))
			b.ResetTimer()
			for range b.N {
				if _, err := c.Write(msg); err != nil {
					b.Fatal(err)
				}
				if _, err := c.Read(buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkUDPBulk: windows of 16 datagrams of 1,400 bytes in flight to an echo backend; MB/s
// counts one direction; lost/op is the share of datagrams whose echo never came.
func BenchmarkUDPBulk(b *testing.B) {
	const size, window = 1400, 16
	for _, mode := range benchModes {
		b.Run(mode.name, func(b *testing.B) {
			c := forwardtest.DialUDP(b, udpTarget(b, mode.proxied, forwardtest.StartUDPEcho(b, forwardtest.Loopback("4"), "")))
			msg := make([]byte, size)
			buf := make([]byte, 2048)
			if _, err := forwardtest.UDPExchange(c, msg, 1, forwardtest.WaitTimeout); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(size)
			lost := 0
			b.ResetTimer()
			for sent := 0; sent < b.N; {
				w := min(window, b.N-sent)
				for range w {
					if _, err := c.Write(msg); err != nil {
						b.Fatal(err)
					}
				}
				sent += w
				c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
				for got := 0; got < w; got++ {
					if _, err := c.Read(buf); err != nil {
						if errors.Is(err, os.ErrDeadlineExceeded) {
							lost += w - got
							break
						}
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(lost)/float64(b.N), "lost/op")
		})
	}
}

// BenchmarkUDPRecvOrigDst measures what IP_RECVORIGDSTADDR adds to receiving a datagram: the
// control message the kernel builds and sys.OrigDstFromOOB parsing it.
func BenchmarkUDPRecvOrigDst(b *testing.B) {
	for _, tc := range []struct {
		name   string
		enable bool
	}{{"Off", false}, {"On", true}} {
		b.Run(tc.name, func(b *testing.B) {
			recv, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
			if err != nil {
				b.Fatal(err)
			}
			defer recv.Close()
			if tc.enable {
				if err := sys.EnableOrigDst(recv); err != nil {
					b.Fatal(err)
				}
			}
			send := forwardtest.DialUDP(b, recv.LocalAddr().(*net.UDPAddr).AddrPort())
			msg, buf, oob := make([]byte, 64), make([]byte, udpBufSize), make([]byte, sys.OrigDstOOBSize)
			b.ResetTimer()
			for range b.N {
				if _, err := send.Write(msg); err != nil {
					b.Fatal(err)
				}
				_, oobn, _, _, err := recv.ReadMsgUDPAddrPort(buf, oob)
				if err != nil {
					b.Fatal(err)
				}
				if got := sys.OrigDstFromOOB(oob[:oobn]); got.IsValid() != tc.enable {
					b.Fatalf("destination %v with the option %v", got, tc.enable)
				}
			}
		})
	}
}
