//go:build linux

package tcp

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// dialOnLoop connects a client to r while every loop of r's but on is busy (their turns held),
// so that on accepts it, and returns it once on has.
func dialOnLoop(t *testing.T, r *proxyRun, on *loop) *net.TCPConn {
	t.Helper()
	before := on.served.Load()
	var c *net.TCPConn
	var hold func(i int)
	lp := r.loopState()
	set := lp.set
	// The listener is attached to one loop after the other, each in its turn: all of them
	// first, or holding a turn would stop the attaching.
	forwardtest.Eventually(t, "the listener on every loop", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return !slices.Contains(lp.lns, nil)
	})
	hold = func(i int) {
		if i == len(set) {
			c = forwardtest.DialTCP(t, r.addr)
			forwardtest.Eventually(t, "the chosen loop to accept", func() bool { return on.served.Load() > before })
			return
		}
		if set[i] == on {
			hold(i + 1)
			return
		}
		set[i].withTurn(func() { hold(i + 1) })
	}
	hold(0)
	return c
}

// loopDialsConsistent checks, in each loop's turn, that its count of dials in progress is the
// number of its connections connecting, and that every connection in its dial list is its own.
func loopDialsConsistent(t *testing.T, ls *Loops) {
	t.Helper()
	for i, l := range ls.loops {
		l.withTurn(func() {
			connecting := 0
			for fd := range l.fds {
				if s := l.fds[fd]; s.c != nil && s.side == 1 && s.c.connecting {
					connecting++
				}
			}
			if l.dialing != connecting {
				t.Errorf("loop %d counts %d dials, %d of its connections are connecting", i, l.dialing, connecting)
			}
			for _, c := range l.dials {
				if c.l != l {
					t.Errorf("loop %d lists a dial of a connection of another loop", i)
				}
			}
		})
	}
}

// A connection accepted on a loop other than its proxy's home loop, frozen while dialling and
// thawed (the hand-over failed), stays its loop's: that loop alone dials it again, times it
// out and resets it, and the other loop, with a dial of its own in progress, never touches it.
func TestLoopThawedDialStaysOnItsLoop(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	loops := newTestLoops(t, 2)
	hole := blackholeEndpoint(t)
	timeouts := []time.Duration{200 * time.Millisecond, 200 * time.Millisecond}
	a := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{hole}}, func(p *Proxy) {
		p.Loops, p.DialTimeouts = loops, timeouts
	})
	other := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{hole}}, func(p *Proxy) {
		p.Loops, p.DialTimeouts = loops, []time.Duration{forwardtest.WaitTimeout}
	})
	away := a.loopState().set[1] // not a's home loop
	c := dialOnLoop(t, a, away)
	// The other proxy keeps a dial in progress on the same loop: its sweep keeps running.
	_ = dialOnLoop(t, other, away)

	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the freeze gives the dials up at once
	st, err := a.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Conns) != 1 || st.Conns[0].Backend != nil {
		t.Fatalf("frozen %d connections (%+v), want one undialled", len(st.Conns), st.Conns)
	}
	_ = st.Close()
	if err := a.Thaw(); err != nil {
		t.Fatal(err)
	}
	if err := <-a.served; err != nil {
		t.Fatalf("Serve before the thaw: %v", err)
	}
	go func() { a.served <- a.Serve() }()
	loopDialsConsistent(t, loops)
	// Both attempts time out on the thawed connection's loop, which resets the client.
	_ = c.SetReadDeadline(time.Now().Add(forwardtest.WaitTimeout))
	if n, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatalf("client read %d bytes, want the reset after the dial attempts", n)
	}
	loopDialsConsistent(t, loops)
	away.withTurn(func() {
		if away.dialing != 1 {
			t.Errorf("the loop counts %d dials, want the other proxy's one", away.dialing)
		}
	})
}
