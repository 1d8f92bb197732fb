//go:build !linux

package userspace

import (
	"errors"
	"io"
	"net/netip"
	"os"
)

// bindTCP fails off Linux: holding ports belongs to the portal rules (--portal-mode iptables),
// which are Linux's.
func bindTCP(ap netip.AddrPort) (io.Closer, error) {
	return nil, errors.New("hold tcp " + ap.String() + ": not supported on this OS (Linux only)")
}

// resetFile closes f (hand-overs, which need the reset, are Linux's).
func resetFile(f *os.File) {
	if f != nil {
		_ = f.Close()
	}
}
