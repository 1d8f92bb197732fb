package forwardtest

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"golang.org/x/sys/unix"
)

// Files collects the files of a state in order.
type Files []*os.File

// Add appends f and returns its index, -1 for a nil f.
func (l *Files) Add(f *os.File) int {
	if f == nil {
		return -1
	}
	*l = append(*l, f)
	return len(*l) - 1
}

// Get returns the file at index i, nil for a negative i.
func (l Files) Get(i int) *os.File {
	if i < 0 {
		return nil
	}
	return l[i]
}

// SocketPair returns the two ends of a Unix stream socket pair.
func SocketPair(t testing.TB) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, b := UnixConnFromFD(t, fds[0]), UnixConnFromFD(t, fds[1])
	return a, b
}

func UnixConnFromFD(t testing.TB, fd int) *net.UnixConn {
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

// SendWire sends v as JSON with files (closing them: they belong to the receiver now).
func SendWire(c *net.UnixConn, v any, files Files) error {
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

// RecvWire receives what SendWire sent into v and returns the files.
func RecvWire(c *net.UnixConn, v any) (Files, error) {
	var hdr [8]byte
	oob := make([]byte, syscall.CmsgSpace(4*64))
	n, oobn, flags, _, err := c.ReadMsgUnix(hdr[:], oob)
	if err != nil {
		return nil, fmt.Errorf("recvmsg: %w", err)
	}
	if flags&syscall.MSG_CTRUNC != 0 {
		return nil, fmt.Errorf("control message truncated")
	}
	var files Files
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

// OpenFDs returns this process's open descriptors, by number, with what they point to.
func OpenFDs(t testing.TB) map[string]string {
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

// CheckNoFDLeaks fails the test if, once its cleanups have run, the process holds sockets or
// pipes it did not hold when the test started. Call it first in a test (before checkNoLeaks is
// fine too), so that its cleanup runs after the others.
func CheckNoFDLeaks(t *testing.T) {
	before := OpenFDs(t)
	t.Cleanup(func() {
		var leaked []string
		deadline := time.Now().Add(WaitTimeout)
		for {
			leaked = leaked[:0]
			for fd, target := range OpenFDs(t) {
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

// SocketFile returns a TCP socket, neither connected nor listening, as a file.
func SocketFile(t *testing.T) *os.File {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	return os.NewFile(uintptr(fd), "socket")
}
