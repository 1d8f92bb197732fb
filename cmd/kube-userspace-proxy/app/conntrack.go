package app

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rs/zerolog"
)

// conntrackSettings are the conntrack sysctls the operator asked for (the --conntrack-* flags or
// the configuration's conntrack section). A zero field leaves its sysctl alone: unlike
// kube-proxy, whose defaults raise nf_conntrack_max and set the TCP timeouts, this proxy changes
// none of them unless asked.
type conntrackSettings struct {
	// Max is net.netfilter.nf_conntrack_max. Setting it also grows the conntrack hash table
	// (/sys/module/nf_conntrack/parameters/hashsize) to Max/4 buckets when it is smaller.
	Max int
	// The timeouts are written in whole seconds.
	TCPEstablishedTimeout time.Duration // net.netfilter.nf_conntrack_tcp_timeout_established
	TCPCloseWaitTimeout   time.Duration // net.netfilter.nf_conntrack_tcp_timeout_close_wait
	TCPBeLiberal          bool          // net.netfilter.nf_conntrack_tcp_be_liberal = 1
	UDPTimeout            time.Duration // net.netfilter.nf_conntrack_udp_timeout
	UDPStreamTimeout      time.Duration // net.netfilter.nf_conntrack_udp_timeout_stream
}

// conntrackSettings returns what the options ask for on a machine with numCPU CPUs.
// nf_conntrack_max is computed as kube-proxy computes it: maxPerCore × CPUs, or min if that is
// larger; with maxPerCore 0 it is left alone (and min ignored).
func (o *Options) conntrackSettings(numCPU int) conntrackSettings {
	s := conntrackSettings{
		TCPEstablishedTimeout: o.ConntrackTCPEstablishedTimeout,
		TCPCloseWaitTimeout:   o.ConntrackTCPCloseWaitTimeout,
		TCPBeLiberal:          o.ConntrackTCPBeLiberal,
		UDPTimeout:            o.ConntrackUDPTimeout,
		UDPStreamTimeout:      o.ConntrackUDPStreamTimeout,
	}
	if o.ConntrackMaxPerCore > 0 {
		s.Max = max(int(o.ConntrackMaxPerCore)*numCPU, int(o.ConntrackMin))
	}
	return s
}

// setConntrack writes the conntrack sysctls the options ask for, in the network namespace of the
// calling thread, and warns about each it could not write.
func setConntrack(opts *Options, log zerolog.Logger) {
	ct := conntrackSysctls{procRoot: "/proc", sysRoot: "/sys", log: log.With().Str("component", "conntrack").Logger()}
	for _, err := range ct.apply(opts.conntrackSettings(runtime.NumCPU())) {
		log.Warn().Err(err).Msg("conntrack sysctl left alone")
	}
}

// conntrackSysctls writes conntrack sysctls through a procfs and a sysfs mount.
type conntrackSysctls struct {
	// procRoot and sysRoot are where procfs and sysfs are mounted: "/proc" and "/sys" but in
	// tests. Sysctls are per network namespace: those of the caller's thread's are written.
	procRoot, sysRoot string
	log               zerolog.Logger
}

// hashsizePath is the conntrack hash table size below sysRoot: a module parameter, global to the
// machine, which the kernel lets only the initial network namespace change.
const hashsizePath = "module/nf_conntrack/parameters/hashsize"

// apply writes every sysctl s sets that does not already have its value. What cannot be
// written is left as it is and reported, one error per sysctl, for the caller to warn about:
// the proxy works with the machine's values, only the operator's tuning is missing.
func (c conntrackSysctls) apply(s conntrackSettings) []error {
	var errs []error
	add := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	if s.Max > 0 {
		add(c.setMax(s.Max))
	}
	seconds := func(d time.Duration) int { return int(d / time.Second) }
	liberal := 0
	if s.TCPBeLiberal {
		liberal = 1
	}
	for _, e := range []struct {
		name  string
		value int
	}{
		{"nf_conntrack_tcp_timeout_established", seconds(s.TCPEstablishedTimeout)},
		{"nf_conntrack_tcp_timeout_close_wait", seconds(s.TCPCloseWaitTimeout)},
		{"nf_conntrack_tcp_be_liberal", liberal},
		{"nf_conntrack_udp_timeout", seconds(s.UDPTimeout)},
		{"nf_conntrack_udp_timeout_stream", seconds(s.UDPStreamTimeout)},
	} {
		if e.value > 0 {
			add(c.setSysctl(e.name, e.value))
		}
	}
	return errs
}

// setMax sets nf_conntrack_max, then grows the hash table to max/4 buckets if it is smaller, as
// kube-proxy does. Both are global to the machine: the kernel makes nf_conntrack_max read-only
// in other network namespaces and refuses hashsize writes from them, and a container runtime may
// mount /sys read-only.
func (c conntrackSysctls) setMax(limit int) error {
	if err := c.setSysctl("nf_conntrack_max", limit); err != nil {
		return err
	}
	path := filepath.Join(c.sysRoot, hashsizePath)
	cur, err := readInt(path)
	if err != nil {
		return fmt.Errorf("conntrack hash table size for nf_conntrack_max %d: %w", limit, err)
	}
	if cur >= limit/4 {
		return nil
	}
	if err := writeInt(path, limit/4); err != nil {
		why := ""
		switch {
		case errors.Is(err, syscall.EROFS):
			why = " (/sys is mounted read-only)"
		case errors.Is(err, syscall.EOPNOTSUPP):
			why = " (only the host's initial network namespace may change it)"
		}
		return fmt.Errorf("conntrack hash table size for nf_conntrack_max %d: left at %d buckets%s: %w", limit, cur, why, err)
	}
	c.log.Info().Str("path", path).Int("from", cur).Int("to", limit/4).Msg("grew the conntrack hash table")
	return nil
}

// setSysctl writes net.netfilter.name unless it already has value.
func (c conntrackSysctls) setSysctl(name string, value int) error {
	key := "net.netfilter." + name
	path := filepath.Join(c.procRoot, "sys/net/netfilter", name)
	cur, err := readInt(path)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("set %s to %d: no such sysctl (is the nf_conntrack module loaded?): %w", key, value, err)
	}
	if err != nil {
		return fmt.Errorf("set %s to %d: %w", key, value, err)
	}
	if cur == value {
		c.log.Debug().Str("sysctl", key).Int("value", value).Msg("conntrack sysctl already set")
		return nil
	}
	if err := writeInt(path, value); err != nil {
		why := ""
		switch {
		case name == "nf_conntrack_max" && errors.Is(err, fs.ErrPermission):
			why = " (read-only outside the host's initial network namespace)"
		case errors.Is(err, fs.ErrPermission) || errors.Is(err, syscall.EROFS):
			why = " (needs CAP_NET_ADMIN and a writable /proc/sys)"
		}
		return fmt.Errorf("set %s to %d: left at %d%s: %w", key, value, cur, why, err)
	}
	c.log.Info().Str("sysctl", key).Int("from", cur).Int("to", value).Msg("set conntrack sysctl")
	return nil
}

func readInt(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", path, err)
	}
	v, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", path, err)
	}
	return v, nil
}

// writeInt writes v to an existing file (a sysctl or module parameter: never created).
func writeInt(path string, v int) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	_, werr := f.WriteString(strconv.Itoa(v))
	if err := errors.Join(werr, f.Close()); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
