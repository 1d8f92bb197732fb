//go:build linux

package forward

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"golang.org/x/sys/unix"
)

// The tests hand states over as another process would: only the files (through a Unix socket,
// with SCM_RIGHTS) and the plain fields (as JSON) cross.

// wireTCP is a TCPState on the wire: files are indices into the descriptors sent with it (-1:
// none).
type wireTCP struct {
	Listener int
	Conns    []wireTCPConn
}

type wireTCPConn struct {
	Client, Backend              int
	ClientAddr, Endpoint         netip.AddrPort
	ToEndpoint, ToClient         []byte
	ToEndpointDone, ToClientDone bool
}

// wireUDP is a UDPState on the wire.
type wireUDP struct {
	Conn     int
	Sessions []wireUDPSession
}

type wireUDPSession struct {
	Backend          int
	Client, Endpoint netip.AddrPort
	ReplyFrom        netip.Addr
	Idle             time.Duration
	Refused          bool
}

// fileList collects the files of a state in order.
type fileList []*os.File

func (l *fileList) add(f *os.File) int {
	if f == nil {
		return -1
	}
	*l = append(*l, f)
	return len(*l) - 1
}

func (l fileList) get(i int) *os.File {
	if i < 0 {
		return nil
	}
	return l[i]
}

// socketPair returns the two ends of a Unix stream socket pair.
func socketPair(t testing.TB) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, b := unixConnFromFD(t, fds[0]), unixConnFromFD(t, fds[1])
	return a, b
}

func unixConnFromFD(t testing.TB, fd int) *net.UnixConn {
	t.Helper()
	f := os.NewFile(uintptr(fd), "unix")
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.UnixConn)
}

// sendWire sends v as JSON with files (closing them: they belong to the receiver now).
func sendWire(c *net.UnixConn, v any, files fileList) error {
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	payload, err := json.Marshal(v)
	if err != nil {
		return err
	}
	fds := make([]int, len(files))
	for i, f := range files {
		if fds[i], err = sys.FD(f); err != nil {
			return err
		}
	}
	var hdr [8]byte
	binary.BigEndian.PutUint32(hdr[:4], uint32(len(payload)))
	binary.BigEndian.PutUint32(hdr[4:], uint32(len(fds)))
	var oob []byte
	if len(fds) > 0 {
		oob = syscall.UnixRights(fds...)
	}
	if _, _, err := c.WriteMsgUnix(hdr[:], oob, nil); err != nil {
		return fmt.Errorf("sendmsg: %w", err)
	}
	_, err = c.Write(payload)
	return err
}

// recvWire receives what sendWire sent into v and returns the files.
func recvWire(c *net.UnixConn, v any) (fileList, error) {
	var hdr [8]byte
	oob := make([]byte, syscall.CmsgSpace(4*64))
	n, oobn, flags, _, err := c.ReadMsgUnix(hdr[:], oob)
	if err != nil {
		return nil, fmt.Errorf("recvmsg: %w", err)
	}
	if flags&syscall.MSG_CTRUNC != 0 {
		return nil, fmt.Errorf("control message truncated")
	}
	var files fileList
	msgs, err := syscall.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return nil, err
	}
	for _, m := range msgs {
		fds, err := syscall.ParseUnixRights(&m)
		if err != nil {
			return nil, err
		}
		for _, fd := range fds {
			files = append(files, os.NewFile(uintptr(fd), "received"))
		}
	}
	if _, err := io.ReadFull(c, hdr[n:]); err != nil {
		return nil, err
	}
	if want := int(binary.BigEndian.Uint32(hdr[4:])); len(files) != want {
		return nil, fmt.Errorf("received %d descriptors, want %d", len(files), want)
	}
	payload := make([]byte, binary.BigEndian.Uint32(hdr[:4]))
	if _, err := io.ReadFull(c, payload); err != nil {
		return nil, err
	}
	return files, json.Unmarshal(payload, v)
}

// sendTCPState sends st, giving up its files.
func sendTCPState(c *net.UnixConn, st TCPState) error {
	var files fileList
	w := wireTCP{Listener: files.add(st.Listener)}
	for _, cs := range st.Conns {
		w.Conns = append(w.Conns, wireTCPConn{Client: files.add(cs.Client), Backend: files.add(cs.Backend),
			ClientAddr: cs.ClientAddr, Endpoint: cs.Endpoint, ToEndpoint: cs.ToEndpoint, ToClient: cs.ToClient,
			ToEndpointDone: cs.ToEndpointDone, ToClientDone: cs.ToClientDone})
	}
	return sendWire(c, w, files)
}

func recvTCPState(c *net.UnixConn) (TCPState, error) {
	var w wireTCP
	files, err := recvWire(c, &w)
	if err != nil {
		return TCPState{}, err
	}
	st := TCPState{Listener: files.get(w.Listener)}
	for _, wc := range w.Conns {
		st.Conns = append(st.Conns, TCPConnState{Client: files.get(wc.Client), Backend: files.get(wc.Backend),
			ClientAddr: wc.ClientAddr, Endpoint: wc.Endpoint, ToEndpoint: wc.ToEndpoint, ToClient: wc.ToClient,
			ToEndpointDone: wc.ToEndpointDone, ToClientDone: wc.ToClientDone})
	}
	return st, nil
}

// sendUDPState sends st, giving up its files.
func sendUDPState(c *net.UnixConn, st UDPState) error {
	var files fileList
	w := wireUDP{Conn: files.add(st.Conn)}
	for _, ss := range st.Sessions {
		w.Sessions = append(w.Sessions, wireUDPSession{Backend: files.add(ss.Backend), Client: ss.Client,
			Endpoint: ss.Endpoint, ReplyFrom: ss.ReplyFrom, Idle: ss.Idle, Refused: ss.Refused})
	}
	return sendWire(c, w, files)
}

func recvUDPState(c *net.UnixConn) (UDPState, error) {
	var w wireUDP
	files, err := recvWire(c, &w)
	if err != nil {
		return UDPState{}, err
	}
	st := UDPState{Conn: files.get(w.Conn)}
	for _, ws := range w.Sessions {
		st.Sessions = append(st.Sessions, UDPSessionState{Backend: files.get(ws.Backend), Client: ws.Client,
			Endpoint: ws.Endpoint, ReplyFrom: ws.ReplyFrom, Idle: ws.Idle, Refused: ws.Refused})
	}
	return st, nil
}

// passUDPState carries st across a Unix socket pair, as to another process.
func passUDPState(t testing.TB, st UDPState) UDPState {
	t.Helper()
	a, b := socketPair(t)
	errc := make(chan error, 1)
	go func() { errc <- sendUDPState(a, st) }()
	got, err := recvUDPState(b)
	if err != nil {
		t.Fatalf("receive UDP state: %v", err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("send UDP state: %v", err)
	}
	return got
}

// passTCPState carries st across a Unix socket pair, as to another process.
func passTCPState(t testing.TB, st TCPState) TCPState {
	t.Helper()
	a, b := socketPair(t)
	errc := make(chan error, 1)
	go func() { errc <- sendTCPState(a, st) }()
	got, err := recvTCPState(b)
	if err != nil {
		t.Fatalf("receive TCP state: %v", err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("send TCP state: %v", err)
	}
	return got
}

// openFDs returns this process's open descriptors, by number, with what they point to.
func openFDs(t testing.TB) map[string]string {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatalf("list fds: %v", err)
	}
	out := make(map[string]string, len(ents))
	for _, e := range ents {
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil {
			out[e.Name()] = target
		}
	}
	return out
}

// checkNoFDLeaks fails the test if, once its cleanups have run, the process holds sockets or
// pipes it did not hold when the test started. Call it first in a test (before checkNoLeaks is
// fine too), so that its cleanup runs after the others.
func checkNoFDLeaks(t *testing.T) {
	before := openFDs(t)
	t.Cleanup(func() {
		var leaked []string
		deadline := time.Now().Add(forwardtest.WaitTimeout)
		for {
			leaked = leaked[:0]
			for fd, target := range openFDs(t) {
				if (strings.HasPrefix(target, "socket:") || strings.HasPrefix(target, "pipe:")) && before[fd] != target {
					leaked = append(leaked, fd+" -> "+target)
				}
			}
			if len(leaked) == 0 || time.Now().After(deadline) {
				break
			}
			// The test's own endpoints copy with io.Copy, whose splice pipes Go pools until
			// a garbage collection.
			runtime.GC()
			time.Sleep(5 * time.Millisecond)
		}
		if len(leaked) > 0 {
			t.Errorf("descriptors left behind: %v", leaked)
		}
	})
}
