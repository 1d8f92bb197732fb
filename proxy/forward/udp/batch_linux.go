package udp

import (
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"golang.org/x/sys/unix"
)

// Batched datagram I/O: recvmmsg(2) and sendmmsg(2), which golang.org/x/sys/unix does not wrap.
// One call moves up to udpBatchLen datagrams, each in a buffer of udpBufSize, so that none is
// ever truncated. The buffers of a batch are one arena taken from a pool only while datagrams
// are being moved: a socket waiting for data holds none.

// udpBatchLen is the most datagrams one recvmmsg or sendmmsg call moves.
const udpBatchLen = 8

// mmsghdr is struct mmsghdr (linux/socket.h): a message header and the length the call moved.
type mmsghdr struct {
	hdr unix.Msghdr
	len uint32
	_   [unix.SizeofPtr - 4]byte // the padding of the array's elements on 64-bit
}

// udpBatch is the memory of one batched receive and of the sends that forward it. Received
// datagram i is in arena[i*udpBufSize:], its source address (when asked) in names[i] and its
// control messages (when asked) in oob[i*sys.OrigDstOOBSize:]. The out headers describe the sends.
type udpBatch struct {
	in     [udpBatchLen]mmsghdr
	inIov  [udpBatchLen]unix.Iovec
	names  [udpBatchLen]unix.RawSockaddrInet6
	out    [udpBatchLen]mmsghdr
	outIov [udpBatchLen]unix.Iovec
	oob    []byte
	arena  []byte
	send   sendState
	sendFn func(fd uintptr) bool // b.send.sendSome

	gso    [1]mmsghdr // a segmented send (gso_linux.go)
	gsoIov [udpBatchLen]unix.Iovec
	gsoOOB []byte
}

// udpBatches holds the batches of every UDP proxy of the process: one is in use per goroutine
// moving datagrams at the moment, not per socket.
var udpBatches = sync.Pool{New: func() any {
	b := &udpBatch{oob: make([]byte, udpBatchLen*sys.OrigDstOOBSize), arena: make([]byte, udpBatchLen*udpBufSize)}
	for i := range b.in {
		b.inIov[i].Base = &b.arena[i*udpBufSize]
		b.inIov[i].SetLen(udpBufSize)
		b.in[i].hdr.Iov = &b.inIov[i]
		b.in[i].hdr.SetIovlen(1)
	}
	b.sendFn = b.send.sendSome
	return b
}}

// getUDPBatch takes a batch from the pool; putUDPBatch returns it.
func getUDPBatch() *udpBatch  { return udpBatches.Get().(*udpBatch) }
func putUDPBatch(b *udpBatch) { udpBatches.Put(b) }

// prepareRecv readies the receive headers: with the sources' addresses and control messages
// (the service port's socket) or without (a session's connected socket).
func (b *udpBatch) prepareRecv(withAddr bool) {
	for i := range b.in {
		h := &b.in[i].hdr
		b.in[i].len = 0
		h.Flags = 0
		if withAddr {
			h.Name = (*byte)(unsafe.Pointer(&b.names[i]))
			h.Namelen = unix.SizeofSockaddrInet6
			h.Control = &b.oob[i*sys.OrigDstOOBSize]
			h.SetControllen(sys.OrigDstOOBSize)
		} else {
			h.Name, h.Namelen, h.Control = nil, 0, nil
			h.SetControllen(0)
		}
	}
}

// source returns the source address of received datagram i, as ReadMsgUDPAddrPort would (an
// IPv4 client of an AF_INET6 socket is mapped; an IPv6 scope is the zone, as its index).
func (b *udpBatch) source(i int) netip.AddrPort {
	n := min(int(b.in[i].hdr.Namelen), unix.SizeofSockaddrInet6)
	raw := unsafe.Slice((*byte)(unsafe.Pointer(&b.names[i])), n)
	ap, ok := sys.ParseSockaddr(raw)
	if !ok {
		return netip.AddrPort{}
	}
	if ap.Addr().Is6() && b.names[i].Scope_id != 0 {
		ap = netip.AddrPortFrom(ap.Addr().WithZone(strconv.FormatUint(uint64(b.names[i].Scope_id), 10)), ap.Port())
	}
	return ap
}

// control returns the control messages received with datagram i.
func (b *udpBatch) control(i int) []byte {
	return b.oob[i*sys.OrigDstOOBSize : i*sys.OrigDstOOBSize+int(b.in[i].hdr.Controllen)]
}

// setOut describes send j: received datagram i, to name (nil on a connected socket) with the
// control messages oob (nil for none). name and oob must stay alive until the send.
func (b *udpBatch) setOut(j, i int, name, oob []byte) {
	b.outIov[j].Base = &b.arena[i*udpBufSize]
	b.outIov[j].SetLen(int(b.in[i].len))
	h := &b.out[j].hdr
	h.Iov = &b.outIov[j]
	h.SetIovlen(1)
	h.Name, h.Namelen = nil, 0
	if len(name) > 0 {
		h.Name, h.Namelen = &name[0], uint32(len(name))
	}
	h.Control = nil
	h.SetControllen(0)
	if len(oob) > 0 {
		h.Control = &oob[0]
		h.SetControllen(len(oob))
	}
	h.Flags = 0
	b.out[j].len = 0
}

// outBytes returns the payload bytes of sends [from, to).
func (b *udpBatch) outBytes(from, to int) int64 {
	var n int64
	for j := from; j < to; j++ {
		n += int64(b.outIov[j].Len)
	}
	return n
}

// recvmmsg and sendmmsg are raw system calls: the sockets are non-blocking, so a call never
// waits for the network, and Go's syscall bookkeeping around a call (entersyscall/exitsyscall)
// was most of the runtime's share of a datagram's cost. A call the kernel preempts (a send on
// loopback or veth delivers the datagram and wakes its receiver inside the call) outlasts sysmon's
// 20 µs, and sysmon then handed the P to another thread and the caller had to get one back: per
// UDP request/response through the proxy (4 clients, kup-load udprr) that was 0.6 futex and 0.4
// nanosleep calls, 1.55 context switches and 30-33 µs of the proxy's CPU; raw, 0.35, 0.02, 1.03
// and 23-24 µs (TestUDPRRExternal under perf stat). The P stays with the caller for the few
// microseconds of a call.

// recvmmsg receives up to len(msgs) datagrams from the non-blocking socket fd. It returns
// EAGAIN when none is waiting.
func recvmmsg(fd int, msgs []mmsghdr) (int, error) { return mmsg(unix.SYS_RECVMMSG, fd, msgs) }

// sendmmsg sends up to len(msgs) datagrams through the non-blocking socket fd and returns how
// many it sent. The error is that of the first datagram: the kernel drops that of a later one
// (a retry from there meets it again, unless it was a one-time error such as a pending ICMP
// error, which the session's reader also sees).
func sendmmsg(fd int, msgs []mmsghdr) (int, error) { return mmsg(unix.SYS_SENDMMSG, fd, msgs) }

// mmsg makes the raw recvmmsg or sendmmsg call (trap), again after EINTR.
func mmsg(trap uintptr, fd int, msgs []mmsghdr) (int, error) {
	for {
		n, _, errno := unix.RawSyscall6(trap, uintptr(fd), uintptr(unsafe.Pointer(&msgs[0])),
			uintptr(len(msgs)), 0, 0, 0)
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			return 0, errno
		}
		return int(n), nil
	}
}

// sendOut sends b.out[from:to] through rc's socket, waiting while its send buffer is full. It
// returns how many it sent and the error that stopped it at b.out[from+sent] (wrapping
// net.ErrClosed when the socket is closed).
func (b *udpBatch) sendOut(rc syscall.RawConn, from, to int, stats *udpBatchStats) (int, error) {
	b.send = sendState{msgs: b.out[from:to], stats: stats}
	err := rc.Write(b.sendFn)
	sent, serr := b.send.sent, b.send.err
	b.send = sendState{}
	if err != nil {
		return sent, err
	}
	return sent, serr
}

// sendState is the progress of one sendOut, which its callback (udpBatch.sendFn, made once per
// batch so that a send allocates nothing) updates.
type sendState struct {
	msgs  []mmsghdr
	stats *udpBatchStats
	sent  int
	err   error
}

// sendSome is sendOut's callback: it sends until done or the buffer is full (false: wait).
func (st *sendState) sendSome(fd uintptr) bool {
	for st.sent < len(st.msgs) {
		n, err := sendmmsg(int(fd), st.msgs[st.sent:])
		if err == unix.EAGAIN {
			return false
		}
		if err != nil {
			st.err = err
			return true
		}
		if st.stats != nil {
			st.stats.sent(n)
		}
		st.sent += n
	}
	return true
}

// udpBatchStats counts the batched calls that moved datagrams and the datagrams they moved, so
// that tests see whether datagrams travel in batches.
type udpBatchStats struct {
	recvCalls, recvMsgs, sendCalls, sendMsgs atomic.Int64
	segmented                                atomic.Int64 // sends of several datagrams in one (UDP_SEGMENT)
}

func (s *udpBatchStats) received(n int) {
	s.recvCalls.Add(1)
	s.recvMsgs.Add(int64(n))
}

func (s *udpBatchStats) sent(n int) {
	s.sendCalls.Add(1)
	s.sendMsgs.Add(int64(n))
}
