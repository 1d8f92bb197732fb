//go:build !linux

package app

import "time"

// notOnThisOS ends the message of an option that needs Linux.
const notOnThisOS = "not supported on this OS (Linux only)"

// oomScoreAdjPath is empty: there is no OOM score to set here, and --oom-score-adj is ignored.
const oomScoreAdjPath = ""

// defaultHandoverSocket is "": an empty --handover-socket means no hand-over here.
func defaultHandoverSocket() (string, error) { return "", nil }

// validateOS refuses the options that need Linux: the portal rules (iptables), the hand-over,
// the conntrack sysctls. Their defaults pass, so --portal-mode none alone runs the proxy.
func validateOS(o *Options, bad func(flag, format string, args ...any)) {
	if o.PortalMode == PortalModeIPTables {
		bad("portal-mode", "%q: %s; use --portal-mode %s", o.PortalMode, notOnThisOS, PortalModeNone)
	}
	if o.HandoverSocket != "" && o.HandoverSocket != HandoverNone {
		bad("handover-socket", "%q: the hand-over is %s; leave it empty or use %q", o.HandoverSocket, notOnThisOS, HandoverNone)
	}
	if o.HolderSocket != "" {
		bad("holder-socket", "%q: the holder is %s; leave it empty", o.HolderSocket, notOnThisOS)
	}
	if o.ConntrackMaxPerCore != 0 {
		bad("conntrack-max-per-core", "%d: %s; use 0", o.ConntrackMaxPerCore, notOnThisOS)
	}
	if o.ConntrackTCPBeLiberal {
		bad("conntrack-tcp-be-liberal", "%s", notOnThisOS)
	}
	for flag, d := range map[string]time.Duration{
		"conntrack-tcp-timeout-established": o.ConntrackTCPEstablishedTimeout,
		"conntrack-tcp-timeout-close-wait":  o.ConntrackTCPCloseWaitTimeout,
		"conntrack-udp-timeout":             o.ConntrackUDPTimeout,
		"conntrack-udp-timeout-stream":      o.ConntrackUDPStreamTimeout,
	} {
		if d != 0 {
			bad(flag, "%v: %s; use 0", d, notOnThisOS)
		}
	}
}
