package iptables

import (
	"errors"
	"fmt"
)

// errNotSupported: iptables exists on Linux only (go-iptables does not build here).
var errNotSupported = errors.New("not supported on this OS")

// newRuleTool fails: there is no iptables here.
func newRuleTool(Family, string, int) (ruleTool, error) {
	return nil, fmt.Errorf("iptables: %w", errNotSupported)
}

// isNotExist reports false: no command ran.
func isNotExist(error) bool { return false }

// exitStatus returns -1: no command ran.
func exitStatus(error) int { return -1 }
