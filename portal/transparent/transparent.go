// Package transparent programs the node so that replies to the proxy's transparent sockets reach
// them.
//
// For an externalTrafficPolicy: Local service whose endpoint is on this node, the proxy connects
// to the endpoint from the client's own address (IP_TRANSPARENT, bound to the client's IP), so
// the endpoint sees the real client. The endpoint answers the client's address; its default
// route is this node, so the answer enters the node, where the kernel would forward it towards
// the client. Rules sets up the well-known fix, per IP family:
//
//	iptables -t mangle -A PREROUTING -j KUBE-PORTALS-TRANSPARENT
//	iptables -t mangle -A KUBE-PORTALS-TRANSPARENT -m addrtype ! --dst-type LOCAL \
//	    -m socket --transparent -j MARK --set-xmark 0x1000/0x1000
//	ip rule add priority 9050 fwmark 0x1000/0x1000 lookup 9050
//	ip route replace local 0.0.0.0/0 dev lo table 9050
//
// A packet that is not addressed to the node but belongs to a local socket with IP_TRANSPARENT
// set (an established or connecting one: -m socket looks the 5-tuple up) is marked; the mark
// selects a routing table in which every address is local, so the packet is delivered to that
// socket instead of being forwarded. The addrtype match spares the socket lookup for traffic to
// the node's own addresses, which is delivered locally anyway.
//
// Rules owns the chain, the ip rule with its priority, mark and table, and the local default
// route in that table; Cleanup removes all of them and nothing else. The mark bit (default
// DefaultMark) must not be used by anything else on the node: kube-proxy uses 0x4000
// (masquerade) and 0x8000 (drop), Calico 0xffff0000 by default, Cilium 0x0f00, Istio 0x539,
// Weave 0x20000 and 0x40000.
//
// The package needs the socket and addrtype matches (xt_socket, xt_addrtype) and iproute2's
// `ip`; both backends of iptables (nft and legacy) work.
package transparent

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
)

// Defaults of Options.
const (
	// DefaultMark is the packet mark bit of replies to transparent sockets (0x1000, bit 12).
	DefaultMark uint32 = 0x1000
	// DefaultTable is the routing table holding the local default route.
	DefaultTable = 9050
	// DefaultPriority is the priority of the ip rule sending marked packets to the table: before
	// the main table (32766) and the usual rules of CNI plugins.
	DefaultPriority = 9050
)

// Chain is the mangle chain, jumped to from PREROUTING, that marks replies to transparent
// sockets.
const Chain = "KUBE-PORTALS-TRANSPARENT"

const (
	tableMangle = "mangle"
	hookChain   = "PREROUTING"
)

// Runner is what Rules needs from an iptables runner (*iptables.Runner).
type Runner interface {
	Family() iptables.Family
	// EnsureRule adds the rule unless it exists.
	EnsureRule(pos iptables.Position, table, chain string, rulespec ...string) (added bool, err error)
	// DeleteJumps deletes every rule in table/chain that jumps to one of targets.
	DeleteJumps(table, chain string, targets ...string) (int, error)
	// DeleteChain flushes and deletes a chain; a missing chain is no error.
	DeleteChain(table, chain string) error
	// Restore applies one table's iptables-restore --noflush input in one exec.
	Restore(table string, payload []byte) error
}

var _ Runner = (*iptables.Runner)(nil)

// Options configures Rules.
type Options struct {
	// Runner runs iptables of the family to program. Required.
	Runner Runner
	// Mark is the mark bit (or bits) set on replies to transparent sockets; zero means
	// DefaultMark.
	Mark uint32
	// Table is the routing table of the local default route; zero means DefaultTable.
	Table int
	// Priority is the ip rule's priority; zero means DefaultPriority.
	Priority int
	// Log receives what Rules changes; the zero Logger discards it.
	Log zerolog.Logger
	// IPCommand is the iproute2 `ip` binary; empty means "ip" on PATH.
	IPCommand string
}

// Rules programs and removes one IP family's rules for transparent sockets. Its methods may be
// called from several goroutines; calls are serialised.
type Rules struct {
	run      Runner
	family   iptables.Family
	mark     uint32
	table    int
	priority int
	log      zerolog.Logger
	ipCmd    string

	mu sync.Mutex // serialises Ensure and Cleanup
}

// New checks opts and returns Rules. It changes nothing on the host.
func New(opts Options) (*Rules, error) {
	if opts.Runner == nil {
		return nil, errors.New("transparent rules: no Runner")
	}
	r := &Rules{
		run: opts.Runner, family: opts.Runner.Family(), mark: opts.Mark, table: opts.Table,
		priority: opts.Priority, log: opts.Log, ipCmd: opts.IPCommand,
	}
	if r.mark == 0 {
		r.mark = DefaultMark
	}
	if r.table == 0 {
		r.table = DefaultTable
	}
	if r.priority == 0 {
		r.priority = DefaultPriority
	}
	if r.ipCmd == "" {
		r.ipCmd = "ip"
	}
	switch {
	case r.table < 0 || r.table == 253 || r.table == 254 || r.table == 255:
		return nil, fmt.Errorf("transparent rules: table %d is reserved or invalid", r.table)
	case r.priority < 1 || r.priority >= 32766:
		return nil, fmt.Errorf("transparent rules: priority %d: want 1..32765 (before the main table)", r.priority)
	}
	return r, nil
}

// Mark returns the mark bits, Table the routing table, and Priority the ip rule's priority in use.
func (r *Rules) Mark() uint32  { return r.mark }
func (r *Rules) Table() int    { return r.table }
func (r *Rules) Priority() int { return r.priority }

func (r *Rules) markArg() string { return fmt.Sprintf("0x%x/0x%x", r.mark, r.mark) }

func (r *Rules) familyArg() string {
	if r.family == iptables.IPv6 {
		return "-6"
	}
	return "-4"
}

func (r *Rules) localDefault() string {
	if r.family == iptables.IPv6 {
		return "::/0"
	}
	return "0.0.0.0/0"
}

// chainRules is the content of Chain.
func (r *Rules) chainRules() []string {
	return []string{"-m", "addrtype", "!", "--dst-type", "LOCAL", "-m", "socket", "--transparent",
		"-m", "comment", "--comment", "replies to kube-userspace-proxy transparent sockets",
		"-j", "MARK", "--set-xmark", r.markArg()}
}

// Ensure creates or restores every rule: the chain's content (rewritten atomically), the jump
// from PREROUTING, the ip rule and the local route. It is cheap enough to call on every sync
// and puts back whatever someone else removed.
func (r *Rules) Ensure(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, ":%s - [0:0]\n-A %s", Chain, Chain)
	for _, a := range r.chainRules() {
		b.WriteByte(' ')
		b.WriteString(iptables.Quote(a))
	}
	b.WriteByte('\n')
	if err := r.run.Restore(tableMangle, []byte(b.String())); err != nil {
		return fmt.Errorf("transparent rules: write %s/%s: %w", tableMangle, Chain, err)
	}
	added, err := r.run.EnsureRule(iptables.Prepend, tableMangle, hookChain,
		"-m", "comment", "--comment", "kube-userspace-proxy transparent sockets", "-j", Chain)
	if err != nil {
		return fmt.Errorf("transparent rules: %w", err)
	}
	if added {
		r.log.Info().Str("family", r.family.String()).Msg("added mangle jump for transparent sockets")
	}
	has, err := r.hasIPRule(ctx)
	if err != nil {
		return err
	}
	if !has {
		if _, err := r.ip(ctx, r.familyArg(), "rule", "add", "priority", strconv.Itoa(r.priority),
			"fwmark", r.markArg(), "lookup", strconv.Itoa(r.table)); err != nil {
			return fmt.Errorf("transparent rules: %w", err)
		}
		r.log.Info().Str("family", r.family.String()).Int("priority", r.priority).Str("fwmark", r.markArg()).
			Int("table", r.table).Msg("added ip rule for transparent sockets")
	}
	if _, err := r.ip(ctx, r.familyArg(), "route", "replace", "local", r.localDefault(), "dev", "lo",
		"table", strconv.Itoa(r.table)); err != nil {
		return fmt.Errorf("transparent rules: %w", err)
	}
	return nil
}

// hasIPRule reports whether our ip rule exists.
func (r *Rules) hasIPRule(ctx context.Context) (bool, error) {
	out, err := r.ip(ctx, r.familyArg(), "rule", "list", "priority", strconv.Itoa(r.priority))
	if err != nil {
		return false, fmt.Errorf("transparent rules: %w", err)
	}
	for _, line := range strings.Split(out, "\n") {
		if r.isOurRule(line) {
			return true, nil
		}
	}
	return false, nil
}

// isOurRule reports whether a line of `ip rule list` is our rule.
func (r *Rules) isOurRule(line string) bool {
	f := strings.Fields(line)
	if len(f) == 0 || f[0] != strconv.Itoa(r.priority)+":" {
		return false
	}
	markOK, tableOK := false, false
	for i := 0; i+1 < len(f); i++ {
		switch f[i] {
		case "fwmark":
			markOK = f[i+1] == r.markArg() || (f[i+1] == fmt.Sprintf("0x%x", r.mark) && r.mark == 0xffffffff)
		case "lookup", "table":
			tableOK = f[i+1] == strconv.Itoa(r.table)
		}
	}
	return markOK && tableOK
}

// Cleanup removes the jump, the chain, every copy of our ip rule and the local route of our
// table. Missing pieces are no error. It needs no earlier Ensure: it also removes what a
// previous run left.
func (r *Rules) Cleanup(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	var errs []error
	n, err := r.run.DeleteJumps(tableMangle, hookChain, Chain)
	if err != nil {
		errs = append(errs, fmt.Errorf("transparent cleanup: %w", err))
	}
	if err := r.run.DeleteChain(tableMangle, Chain); err != nil {
		errs = append(errs, fmt.Errorf("transparent cleanup: %w", err))
	}
	rules := 0
	for range 64 { // duplicates of the rule, bounded
		has, err := r.hasIPRule(ctx)
		if err != nil {
			errs = append(errs, fmt.Errorf("transparent cleanup: %w", err))
			break
		}
		if !has {
			break
		}
		if _, err := r.ip(ctx, r.familyArg(), "rule", "del", "priority", strconv.Itoa(r.priority),
			"fwmark", r.markArg(), "lookup", strconv.Itoa(r.table)); err != nil {
			errs = append(errs, fmt.Errorf("transparent cleanup: %w", err))
			break
		}
		rules++
	}
	routes := 0
	if out, err := r.ip(ctx, r.familyArg(), "route", "show", "table", strconv.Itoa(r.table), "type", "local"); err != nil {
		if !isNoSuchTable(err) {
			errs = append(errs, fmt.Errorf("transparent cleanup: %w", err))
		}
	} else if strings.TrimSpace(out) != "" {
		if _, err := r.ip(ctx, r.familyArg(), "route", "del", "local", r.localDefault(), "dev", "lo",
			"table", strconv.Itoa(r.table)); err != nil && !isNoSuchRoute(err) {
			errs = append(errs, fmt.Errorf("transparent cleanup: %w", err))
		} else if err == nil {
			routes++
		}
	}
	if n+rules+routes > 0 {
		r.log.Info().Str("family", r.family.String()).Int("jumps", n).Int("ipRules", rules).Int("routes", routes).
			Msg("removed rules for transparent sockets")
	}
	return errors.Join(errs...)
}

// ipError is a failed `ip` command.
type ipError struct {
	args   []string
	stderr string
	err    error
}

func (e *ipError) Error() string {
	return fmt.Sprintf("ip %s: %v: %s", strings.Join(e.args, " "), e.err, strings.TrimSpace(e.stderr))
}

func (e *ipError) Unwrap() error { return e.err }

func isNoSuchRoute(err error) bool {
	var ie *ipError
	return errors.As(err, &ie) && (strings.Contains(ie.stderr, "No such process") || strings.Contains(ie.stderr, "No such file"))
}

func isNoSuchTable(err error) bool {
	var ie *ipError
	return errors.As(err, &ie) && strings.Contains(ie.stderr, "table") && strings.Contains(ie.stderr, "does not exist")
}

// ip runs the ip command with args and returns its standard output.
func (r *Rules) ip(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, r.ipCmd, args...)
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", &ipError{args: args, stderr: stderr.String(), err: err}
	}
	return stdout.String(), nil
}
