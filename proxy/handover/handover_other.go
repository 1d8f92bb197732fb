//go:build !linux

package handover

import (
	"errors"
	"net"
	"os"
	"syscall"
)

// errNotSupported is what every hand-over returns off Linux: the hand-over is built for the
// Linux engine's sockets and for one proxy per network namespace (/proc/self/ns/net).
var errNotSupported = errors.New("hand-over: not supported on this OS (Linux only); run with --handover-socket=none")

func supported() error { return errNotSupported }

// Dup fails off Linux (see errNotSupported).
func Dup(f *os.File) (*os.File, error) { return nil, errNotSupported }

func unixRights([]int) []byte                { return nil }
func rightsSpace(int) int                    { return 0 }
func truncated(int) bool                     { return false }
func inode(os.FileInfo) uint64               { return 0 }
func parseRights([]byte) ([]*os.File, error) { return nil, errNotSupported }

func peerCred(*net.UnixConn) (int, int, error) { return 0, 0, errNotSupported }
func selfNetNS() uint64                        { return 0 }
func lockFile(string) (*os.File, error)        { return nil, errNotSupported }
func detachSocket(f *os.File) (int, error)     { _ = f.Close(); return -1, errNotSupported }
func dupConn(syscall.Conn) (int, error)        { return -1, errNotSupported }
func closeFD(int)                              {}
