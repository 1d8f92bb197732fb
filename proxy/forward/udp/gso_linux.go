package udp

import (
	"encoding/binary"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"golang.org/x/sys/unix"
)

// UDP generic segmentation offload (UDP_SEGMENT, Linux 4.18): a run of equal-size datagrams
// from one client to its endpoint leaves in one sendmsg(2) of their concatenation, which the
// kernel cuts back into the datagrams as late as it can (at the device, or not at all on
// loopback and veth up to the receiving socket), so that the stack handles one packet instead
// of several. The datagrams stay where recvmmsg put them: the message has one iovec per
// datagram.

// udpMaxSegments is the most datagrams one segmented send carries (UDP_MAX_SEGMENTS of Linux
// 4.18 was 64; a batch is smaller).
const udpMaxSegments = 64

// gsoDisabled is set when a segmented send failed in a way that says the kernel or the device
// cannot segment: every later run goes through sendmmsg.
var gsoDisabled atomic.Bool

// gsoSupported reports whether the kernel knows UDP_SEGMENT. A kernel without it would ignore
// the control message and send the concatenation as one datagram, so this is checked before the
// first segmented send.
var gsoSupported = sync.OnceValue(func() bool {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	_, err = unix.GetsockoptInt(fd, unix.SOL_UDP, unix.UDP_SEGMENT)
	return err == nil
})

// segmentable reports whether b's received datagrams [from, to) can leave in one segmented
// send: at least two, all of the first one's size but the last, which may be shorter, and
// together no larger than a datagram.
func (b *udpBatch) segmentable(from, to int) bool {
	if to-from < 2 || to-from > udpMaxSegments || gsoDisabled.Load() {
		return false
	}
	size := b.in[from].len
	if size == 0 {
		return false
	}
	total := 0
	for i := from; i < to; i++ {
		if n := b.in[i].len; n > size || (n < size && i != to-1) || n == 0 {
			return false
		}
		total += int(b.in[i].len)
	}
	return total <= 65507 && gsoSupported()
}

// sendSegmented sends b's received datagrams [from, to) (segmentable) through rc's connected
// socket in one segmented send, waiting while its buffer is full. It reports false when the
// send could not be segmented (the datagrams were not sent: send them one by one); otherwise
// the error, if any, is that of every datagram of the run.
func (b *udpBatch) sendSegmented(rc syscall.RawConn, from, to int, stats *udpBatchStats) (ok bool, err error) {
	for i := from; i < to; i++ {
		b.gsoIov[i-from].Base = &b.arena[i*udpBufSize]
		b.gsoIov[i-from].SetLen(int(b.in[i].len))
	}
	b.gsoOOB = sys.AppendCmsg(b.gsoOOB[:0], unix.SOL_UDP, unix.UDP_SEGMENT, binary.NativeEndian.AppendUint16(nil, uint16(b.in[from].len)))
	h := &b.gso[0].hdr
	*h = unix.Msghdr{Iov: &b.gsoIov[0], Control: &b.gsoOOB[0]}
	h.SetIovlen(to - from)
	h.SetControllen(len(b.gsoOOB))
	b.send = sendState{msgs: b.gso[:], stats: nil}
	werr := rc.Write(b.sendFn)
	serr := b.send.err
	b.send = sendState{}
	switch {
	case werr != nil:
		return true, werr
	case serr == nil:
		stats.sent(to - from)
		stats.segmented.Add(1)
		return true, nil
	case serr == unix.EIO || serr == unix.ENOPROTOOPT || serr == unix.EOPNOTSUPP:
		gsoDisabled.Store(true) // the device or the kernel cannot segment
		return false, nil
	case serr == unix.EINVAL || serr == unix.EMSGSIZE:
		return false, nil // larger than the path allows a segment: this run only
	}
	return true, serr
}
