//go:build !linux

package userspace

import (
	"errors"
	"io"
	"net/netip"
	"os"

	v1 "k8s.io/api/core/v1"
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

// checkProxySocket fails off Linux: the listener store is Linux's, as hand-overs are.
func checkProxySocket(_ *os.File, _ v1.Protocol, want netip.AddrPort) error {
	return errors.New("listener of " + want.String() + " from the holder: not supported on this OS (Linux only)")
}
