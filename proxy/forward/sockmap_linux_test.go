//go:build sockmapmeasure

// Issue 15: a reference relay on a BPF sockmap, measured against splice and not a data path of
// the proxy (bench/README.md, "Issue 15, session 26"). Built only with the sockmapmeasure tag:
// go test -tags sockmapmeasure -run Sockmap -bench Sockmap ./proxy/forward/ (root, or CAP_BPF
// and CAP_NET_ADMIN).

package forward

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// A reference relay on a BPF sockmap (issue 15), for measurement only: not a data path of the
// proxy. Both sockets of a pair sit in a SOCKMAP; an sk_skb verdict program (BPF_SK_SKB_VERDICT,
// no stream parser) runs on every skb a socket of the map receives, looks up the socket's cookie
// in a hash of pairs and redirects the skb to the egress of the peer's socket, adding its length
// to the pair's byte counter. A failed redirect (the peer not in the map yet) passes the skb to
// the socket's own receive queue, where the relay reads and copies it. User space only waits
// for each source's EOF, then half-closes the peer once every redirected byte has entered the
// peer's send queue (the barrier of halfCloseAfter).

// smPair is the value of the pairs hash, keyed by a socket's cookie (SO_COOKIE).
type smPair struct {
	Peer  uint32 // the index of the peer's socket in the SOCKMAP
	Pad   uint32
	Bytes uint64 // bytes redirected from this socket to the peer (skb->len summed)
}

const smSlots = 1024

type sockmapRelay struct {
	socks *ebpf.Map // SOCKMAP: index → socket
	pairs *ebpf.Map // HASH: socket cookie → smPair
	prog  *ebpf.Program

	mu   sync.Mutex
	free []uint32 // free pair slots (even indexes)

	copied atomic.Int64 // bytes user space had to copy (skbs passed, not redirected)
}

// smProgram is the verdict program:
//
//	if skb->len == 0: return SK_PASS (an empty skb: the FIN's)
//	v = pairs[bpf_get_socket_cookie(skb)]; if !v: return SK_PASS
//	if bpf_sk_redirect_map(skb, socks, v.peer, 0) != SK_PASS: return SK_PASS (to user space)
//	atomic v.bytes += skb->len; return SK_PASS (redirected)
func smProgram(socks, pairs *ebpf.Map) asm.Instructions {
	return asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.LoadMem(asm.R2, asm.R6, 0, asm.Word), // skb->len
		asm.JEq.Imm(asm.R2, 0, "pass"),           // the FIN's empty skb stays
		asm.FnGetSocketCookie.Call(),
		asm.StoreMem(asm.RFP, -8, asm.R0, asm.DWord),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -8),
		asm.LoadMapPtr(asm.R1, pairs.FD()),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "pass"),
		asm.Mov.Reg(asm.R7, asm.R0),
		asm.Mov.Reg(asm.R1, asm.R6),
		asm.LoadMapPtr(asm.R2, socks.FD()),
		asm.LoadMem(asm.R3, asm.R7, 0, asm.Word),
		asm.Mov.Imm(asm.R4, 0), // egress of the peer
		asm.FnSkRedirectMap.Call(),
		asm.JNE.Imm(asm.R0, 1, "pass"),
		asm.LoadMem(asm.R1, asm.R6, 0, asm.Word), // skb->len
		asm.AddAtomic.Mem(asm.R7, asm.R1, asm.DWord, 8),
		asm.Mov.Imm(asm.R0, 1),
		asm.Return(),
		asm.Mov.Imm(asm.R0, 1).WithSymbol("pass"),
		asm.Return(),
	}
}

// newSockmapRelay loads the maps and the program and attaches it; it fails where the kernel or
// the capabilities do not allow it.
func newSockmapRelay() (*sockmapRelay, error) {
	socks, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.SockMap, KeySize: 4, ValueSize: 4, MaxEntries: smSlots})
	if err != nil {
		return nil, fmt.Errorf("sockmap: %w", err)
	}
	pairs, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: 16, MaxEntries: smSlots})
	if err != nil {
		socks.Close()
		return nil, fmt.Errorf("pairs hash: %w", err)
	}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.SkSKB, AttachType: ebpf.AttachSkSKBVerdict, License: "GPL",
		Instructions: smProgram(socks, pairs),
	})
	if err == nil {
		err = attachRaw(socks, prog)
		if err != nil {
			prog.Close()
		}
	}
	if err != nil {
		socks.Close()
		pairs.Close()
		return nil, fmt.Errorf("verdict program: %w", err)
	}
	r := &sockmapRelay{socks: socks, pairs: pairs, prog: prog}
	for i := uint32(0); i < smSlots; i += 2 {
		r.free = append(r.free, i)
	}
	return r, nil
}

// attachRaw attaches prog to the map as its BPF_SK_SKB_VERDICT program (BPF_PROG_ATTACH).
func attachRaw(m *ebpf.Map, prog *ebpf.Program) error {
	return link.RawAttachProgram(link.RawAttachProgramOptions{Target: m.FD(), Program: prog, Attach: ebpf.AttachSkSKBVerdict})
}

func (r *sockmapRelay) Close() {
	r.prog.Close()
	r.socks.Close()
	r.pairs.Close()
}

func sockFD(c *net.TCPConn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	var fd int
	if err := rc.Control(func(f uintptr) { fd = int(f) }); err != nil {
		return -1, err
	}
	return fd, nil
}

// smConn is one socket of a pair in the map.
type smConn struct {
	c      *net.TCPConn
	fd     int
	cookie uint64
	idx    uint32
	base   int64 // sendQueued when the pair was put in the map
}

// sendQueued returns the bytes the socket's send queue has taken so far: acknowledged
// (tcpi_bytes_acked) plus not yet acknowledged (SIOCOUTQ).
func sendQueued(fd int) (int64, error) {
	info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
	if err != nil {
		return 0, err
	}
	outq, err := unix.IoctlGetInt(fd, unix.SIOCOUTQ)
	if err != nil {
		return 0, err
	}
	return int64(info.Bytes_acked) + int64(outq), nil
}

func newSMConn(c *net.TCPConn) (*smConn, error) {
	fd, err := sockFD(c)
	if err != nil {
		return nil, err
	}
	cookie, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		return nil, err
	}
	base, err := sendQueued(fd)
	if err != nil {
		return nil, err
	}
	return &smConn{c: c, fd: fd, cookie: cookie, base: base}, nil
}

// smPairRun is one relayed pair.
type smPairRun struct {
	r    *sockmapRelay
	a, b *smConn // client side, endpoint side
	slot uint32
	// barrierTimeout bounds halfCloseAfter's wait (0: 5 s).
	barrierTimeout atomic.Int64
	// noBarrier: half-close at EOF at once (to show what the barrier prevents).
	noBarrier atomic.Bool
	// up and down are the bytes redirected each way, copied those passed to user space and
	// copied, once run has returned (done closed).
	up, down, copied atomic.Int64
	done             chan struct{}
	// gate is held by handOver while it takes the pair out of the map: a direction writes what
	// it read only under gate's read lock, so that its copy cannot overtake redirected bytes.
	gate sync.RWMutex
}

// add puts a pair in the map: the pairs entries first, then the endpoint's socket, then the
// client's (until the client's is in, the endpoint's skbs fail to redirect and are passed).
func (r *sockmapRelay) add(client, endpoint *net.TCPConn) (*smPairRun, error) {
	a, err := newSMConn(client)
	if err != nil {
		return nil, err
	}
	b, err := newSMConn(endpoint)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	if len(r.free) == 0 {
		r.mu.Unlock()
		return nil, errors.New("sockmap full")
	}
	slot := r.free[len(r.free)-1]
	r.free = r.free[:len(r.free)-1]
	r.mu.Unlock()
	a.idx, b.idx = slot, slot+1
	p := &smPairRun{r: r, a: a, b: b, slot: slot, done: make(chan struct{})}
	if err := r.pairs.Put(a.cookie, smPair{Peer: b.idx}); err != nil {
		p.release()
		return nil, err
	}
	if err := r.pairs.Put(b.cookie, smPair{Peer: a.idx}); err != nil {
		p.release()
		return nil, err
	}
	if err := r.socks.Put(b.idx, uint32(b.fd)); err != nil {
		p.release()
		return nil, fmt.Errorf("endpoint socket into the sockmap: %w", err)
	}
	if err := r.socks.Put(a.idx, uint32(a.fd)); err != nil {
		p.release()
		return nil, fmt.Errorf("client socket into the sockmap: %w", err)
	}
	return p, nil
}

// remove takes both sockets out of the map at once: the skbs still queued in the psock
// backlog of either are dropped with it (TestSockmapHandOver/Abrupt).
func (p *smPairRun) remove() {
	p.r.socks.Delete(p.a.idx)
	p.r.socks.Delete(p.b.idx)
}

// handOver takes the pair out of the map while data flows from the client to the endpoint.
// drained: the client's socket first (its skbs stop being redirected and stay in its receive
// queue for user space), then, once the endpoint's send queue has taken every byte redirected
// to it, the endpoint's; else both at once. User space copies whatever comes after.
func (p *smPairRun) handOver(drained bool) error {
	p.gate.Lock()
	defer p.gate.Unlock()
	if !drained {
		p.remove()
		return nil
	}
	if err := p.r.socks.Delete(p.a.idx); err != nil {
		return err
	}
	n, err := p.redirected(p.a)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		q, err := sendQueued(p.b.fd)
		if err != nil {
			return err
		}
		if q-p.b.base >= int64(n)+p.copied.Load() {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the endpoint's send queue took %d of %d bytes", q-p.b.base, n)
		}
		time.Sleep(20 * time.Microsecond)
	}
	return p.r.socks.Delete(p.b.idx)
}

// release removes the pair from both maps and frees its slot.
func (p *smPairRun) release() {
	p.remove()
	p.r.pairs.Delete(p.a.cookie)
	p.r.pairs.Delete(p.b.cookie)
	p.r.mu.Lock()
	p.r.free = append(p.r.free, p.slot)
	p.r.mu.Unlock()
}

// redirected returns the bytes the program redirected from c to its peer.
func (p *smPairRun) redirected(c *smConn) (uint64, error) {
	var v smPair
	if err := p.r.pairs.Lookup(c.cookie, &v); err != nil {
		return 0, err
	}
	return v.Bytes, nil
}

// run relays until both directions have seen EOF, then releases the pair; it returns the
// bytes redirected each way (client→endpoint, endpoint→client).
func (p *smPairRun) run() (up, down uint64, err error) {
	var wg sync.WaitGroup
	var errUp, errDown error
	wg.Add(2)
	// A failed direction closes both sockets, which ends the other.
	abort := func(err error) {
		if err != nil {
			p.a.c.Close()
			p.b.c.Close()
		}
	}
	go func() { defer wg.Done(); up, errUp = p.direction(p.a, p.b); abort(errUp) }()
	go func() { defer wg.Done(); down, errDown = p.direction(p.b, p.a); abort(errDown) }()
	wg.Wait()
	p.up.Store(int64(up))
	p.down.Store(int64(down))
	p.release()
	close(p.done)
	return up, down, errors.Join(errUp, errDown)
}

// direction waits for src's EOF, copying any skb passed to user space, then half-closes dst
// once every byte redirected from src has entered dst's send queue.
func (p *smPairRun) direction(src, dst *smConn) (uint64, error) {
	rc, err := src.c.SyscallConn()
	if err != nil {
		return 0, err
	}
	var buf []byte
	var copied int64
	eof := false
	var opErr error
	for !eof && opErr == nil {
		var pending []byte
		err := rc.Read(func(fd uintptr) bool {
			if buf == nil {
				buf = make([]byte, copyBufSize)
			}
			n, _, err := unix.Recvfrom(int(fd), buf, unix.MSG_DONTWAIT)
			switch {
			case err == unix.EAGAIN:
				return false
			case err != nil:
				opErr = fmt.Errorf("recv: %w", err)
			case n == 0:
				eof = true
			default:
				pending = buf[:n]
			}
			return true
		})
		if err != nil {
			return 0, err
		}
		if len(pending) > 0 {
			p.gate.RLock()
			_, err := dst.c.Write(pending)
			p.gate.RUnlock()
			if err != nil {
				return 0, fmt.Errorf("copying %d passed bytes: %w", len(pending), err)
			}
			copied += int64(len(pending))
			p.r.copied.Add(int64(len(pending)))
			p.copied.Add(int64(len(pending)))
		}
	}
	if opErr != nil {
		return 0, opErr
	}
	var n uint64
	if p.noBarrier.Load() {
		if n, err = p.redirected(src); err != nil {
			return 0, err
		}
	} else if n, err = p.halfCloseAfter(src, dst, copied); err != nil {
		return n, err
	}
	if err := dst.c.CloseWrite(); err != nil {
		return n, fmt.Errorf("half-close after %d redirected bytes: %w", n, err)
	}
	return n, nil
}

// halfCloseAfter waits, once src has seen its EOF, until the verdict program has taken every
// byte src received (tcpi_bytes_received, which counts the FIN too, against the bytes redirected
// plus those copied): the FIN wakes the reader before the verdict runs on the skb that carried
// it. Then it waits until dst's send queue has taken them all: redirected skbs reach it through
// dst's psock backlog (a work item). It returns the bytes redirected.
func (p *smPairRun) halfCloseAfter(src, dst *smConn, copied int64) (uint64, error) {
	timeout := time.Duration(p.barrierTimeout.Load())
	if timeout == 0 {
		timeout = 5 * time.Second
	}
	deadline := time.Now().Add(timeout)
	for {
		n, err := p.redirected(src)
		if err != nil {
			return 0, err
		}
		info, err := unix.GetsockoptTCPInfo(src.fd, unix.IPPROTO_TCP, unix.TCP_INFO)
		if err != nil {
			return n, err
		}
		want := int64(n) + copied
		if int64(info.Bytes_received)-1 <= want {
			q, err := sendQueued(dst.fd)
			if err != nil {
				return n, err
			}
			if q-dst.base >= want {
				return n, nil
			}
		}
		if time.Now().After(deadline) {
			return n, fmt.Errorf("%d bytes received, %d redirected or copied: the rest never reached the peer in %v", info.Bytes_received-1, want, timeout)
		}
		time.Sleep(20 * time.Microsecond)
	}
}

// smListener serves a sockmap relay in front of backend; paired gets each pair once it is in
// the map.
type smListener struct {
	ln     *net.TCPListener
	r      *sockmapRelay
	paired chan *smPairRun
	wg     sync.WaitGroup
	errs   chan error // failures to set a pair up
	// runErrs counts the pairs whose run failed, lastErr the last failure.
	runErrs atomic.Int64
	lastErr atomic.Value
}

func startSockmapRelay(t testing.TB, backend netip.AddrPort) *smListener {
	t.Helper()
	r, err := newSockmapRelay()
	if err != nil {
		t.Fatalf("sockmap unavailable: %v", err)
	}
	s := &smListener{ln: listenTCP(t, loopback("4")), r: r, paired: make(chan *smPairRun, 16), errs: make(chan error, 16)}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := s.ln.AcceptTCP()
			if err != nil {
				return
			}
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer c.Close()
				e, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(backend))
				if err != nil {
					s.errs <- err
					return
				}
				defer e.Close()
				p, err := r.add(c, e)
				if err != nil {
					s.errs <- err
					return
				}
				select {
				case s.paired <- p:
				default:
				}
				if _, _, err := p.run(); err != nil {
					s.runErrs.Add(1)
					s.lastErr.Store(err)
				}
			}()
		}
	}()
	t.Cleanup(func() {
		s.ln.Close()
		s.wg.Wait()
		r.Close()
	})
	return s
}

func (s *smListener) addr() netip.AddrPort { return listenerAddr(s.ln) }

// dialPaired dials the relay and waits until the pair is in the map.
func (s *smListener) dialPaired(t testing.TB) (*net.TCPConn, *smPairRun) {
	t.Helper()
	c := dialTCPTest(t, s.addr())
	select {
	case p := <-s.paired:
		return c, p
	case err := <-s.errs:
		t.Fatalf("relay: %v", err)
	case <-time.After(waitTimeout):
		t.Fatal("relay did not pair the connection")
	}
	return nil, nil
}
