//go:build !windows

package iptables

import (
	"errors"

	goipt "github.com/coreos/go-iptables/iptables"
)

// newRuleTool returns the go-iptables handle of the iptables binary at path, waiting up to secs
// for the xtables lock.
func newRuleTool(f Family, path string, secs int) (ruleTool, error) {
	proto := goipt.ProtocolIPv4
	if f == IPv6 {
		proto = goipt.ProtocolIPv6
	}
	return goipt.New(goipt.IPFamily(proto), goipt.Path(path), goipt.Timeout(secs))
}

// isNotExist reports whether err says the rule or chain does not exist.
func isNotExist(err error) bool {
	var ierr *goipt.Error
	return errors.As(err, &ierr) && ierr.IsNotExist()
}

// exitStatus returns the exit status of the failed command behind err, or -1.
func exitStatus(err error) int {
	var ierr *goipt.Error
	if errors.As(err, &ierr) {
		return ierr.ExitStatus()
	}
	return -1
}
