//go:build sockmapmeasure

// Kernel behaviour of the sockmap reference relay (sockmap_linux_test.go): half-close ordering
// and hand-over. go test -tags sockmapmeasure -run Sockmap ./proxy/forward/

package forward

import (
	"bytes"
	"io"
	"math/rand/v2"
	"net"
	"testing"
	"time"
)

// TestSockmapRelayEcho: 8 MiB echoed through the reference sockmap relay arrive intact, every
// byte redirected by the verdict program (none passed to user space), and the half-close
// travels both ways.
func TestSockmapRelayEcho(t *testing.T) {
	s := startSockmapRelay(t, startTCPEcho(t, loopback("4")))
	c, p := s.dialPaired(t)
	const payload = 8 << 20
	msg := make([]byte, payload)
	rand.NewChaCha8([32]byte{5}).Read(msg)
	werr := make(chan error, 1)
	go func() {
		_, err := c.Write(msg)
		if err == nil {
			err = c.CloseWrite()
		}
		werr <- err
	}()
	got, err := io.ReadAll(c)
	if err != nil || <-werr != nil {
		t.Fatalf("transfer: %v", err)
	}
	if !bytes.Equal(got, msg) {
		t.Fatalf("echo differs: %d bytes, want %d", len(got), len(msg))
	}
	<-p.done
	up, down := p.up.Load(), p.down.Load()
	if s.runErrs.Load() > 0 {
		t.Errorf("relay: %v", s.lastErr.Load())
	}
	if up != payload || down != payload || s.r.copied.Load() != 0 {
		t.Fatalf("redirected %d up, %d down, copied %d: want %d, %d, 0", up, down, s.r.copied.Load(), payload, payload)
	}
}

// TestSockmapHalfCloseOrder: a client sends a burst and half-closes at once; the endpoint must
// read the whole burst before EOF. The relay half-closes the endpoint side when it sees the
// client's EOF; without the barrier (noBarrier) the FIN can overtake redirected bytes still in
// the peer's psock backlog, which the test logs.
func TestSockmapHalfCloseOrder(t *testing.T) {
	for _, tc := range []struct {
		name      string
		noBarrier bool
	}{{"Barrier", false}, {"NoBarrier", true}} {
		t.Run(tc.name, func(t *testing.T) {
			got := make(chan int64, 1)
			backend := startTCPServer(t, loopback("4"), func(c *net.TCPConn) {
				n, _ := io.Copy(io.Discard, c)
				got <- n
			})
			s := startSockmapRelay(t, backend)
			const rounds, burst = 200, 1 << 20
			msg := make([]byte, burst)
			short := 0
			for i := range rounds {
				c, p := s.dialPaired(t)
				p.noBarrier.Store(tc.noBarrier)
				if _, err := c.Write(msg); err != nil {
					t.Fatal(err)
				}
				if err := c.CloseWrite(); err != nil {
					t.Fatal(err)
				}
				var n int64
				select {
				case n = <-got:
				case <-time.After(waitTimeout):
					t.Fatalf("round %d: endpoint saw no EOF", i)
				}
				c.Close()
				<-p.done
				if n != burst {
					short++
					if short <= 3 {
						t.Logf("round %d: endpoint read %d of %d bytes before EOF (%d redirected, %d copied)", i, n, burst, p.up.Load(), p.copied.Load())
					}
				}
			}
			t.Logf("%d of %d rounds cut short; %d relay errors (last: %v)", short, rounds, s.runErrs.Load(), s.lastErr.Load())
			if (short > 0 || s.runErrs.Load() > 0) && !tc.noBarrier {
				t.Errorf("with the barrier, %d of %d rounds lost bytes, %d failed", short, rounds, s.runErrs.Load())
			}
		})
	}
}

// TestSockmapHandOver takes a pair out of the map while 32 MiB stream from the client to the
// endpoint (a hand-over must do so before it exports the sockets): user space copies what
// comes after. Abrupt removes both sockets at once: the skbs redirected to the endpoint but not
// yet sent by its psock backlog are dropped with the psock, which the test logs. Drained removes
// the source first and the endpoint once its send queue has taken every redirected byte: the
// stream must arrive intact.
func TestSockmapHandOver(t *testing.T) {
	for _, tc := range []struct {
		name    string
		drained bool
	}{{"Drained", true}, {"Abrupt", false}} {
		t.Run(tc.name, func(t *testing.T) {
			type result struct {
				n        int64
				mismatch int64 // first offset whose byte differs, -1: none
			}
			got := make(chan result, 1)
			backend := startTCPServer(t, loopback("4"), func(c *net.TCPConn) {
				c.SetDeadline(time.Now().Add(waitTimeout))
				buf := make([]byte, 64<<10)
				r := result{mismatch: -1}
				for {
					n, err := c.Read(buf)
					for i := range n {
						if r.mismatch < 0 && buf[i] != byte((r.n+int64(i))%251) {
							r.mismatch = r.n + int64(i)
						}
					}
					r.n += int64(n)
					if err != nil {
						break
					}
				}
				got <- r
			})
			s := startSockmapRelay(t, backend)
			c, p := s.dialPaired(t)
			if !tc.drained {
				p.barrierTimeout.Store(int64(200 * time.Millisecond)) // the dropped bytes never come
			}
			const payload, chunk = 32 << 20, 64 << 10
			msg := make([]byte, payload)
			for i := range msg {
				msg[i] = byte(i % 251)
			}
			werr := make(chan error, 1)
			go func() {
				var err error
				for off := 0; off < payload && err == nil; off += chunk {
					_, err = c.Write(msg[off : off+chunk])
					if off == 4<<20 {
						err = p.handOver(tc.drained)
					}
				}
				if err == nil {
					err = c.CloseWrite()
				}
				werr <- err
			}()
			var r result
			select {
			case r = <-got:
			case <-time.After(waitTimeout):
				t.Fatal("the endpoint saw no EOF")
			}
			if err := <-werr; err != nil {
				t.Fatal(err)
			}
			<-p.done
			t.Logf("endpoint read %d of %d bytes, first wrong byte at %d; %d redirected before the hand-over, %d copied after",
				r.n, payload, r.mismatch, p.up.Load(), p.copied.Load())
			if tc.drained && (r.n != payload || r.mismatch >= 0) {
				t.Errorf("drained hand-over lost or reordered bytes")
			}
		})
	}
}
