package portal

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
)

// Runner is what a Manager needs from an iptables runner (*iptables.Runner).
type Runner interface {
	Family() iptables.Family
	// EnsureChain creates a chain unless it exists.
	EnsureChain(table, chain string) error
	// List returns a chain's rules as `iptables -S` prints them.
	List(table, chain string) ([]string, error)
	// EnsureRule adds the rule (first or last) unless it exists; added says whether it did.
	EnsureRule(pos iptables.Position, table, chain string, rulespec ...string) (added bool, err error)
	// DeleteJumps deletes every rule in table/chain that jumps to one of targets.
	DeleteJumps(table, chain string, targets ...string) (int, error)
	// DeleteChain flushes and deletes a chain; a missing chain is no error.
	DeleteChain(table, chain string) error
	// Restore applies one table's iptables-restore --noflush input in one exec.
	Restore(table string, payload []byte) error
}

var _ Runner = (*iptables.Runner)(nil)

// Options configures a Manager.
type Options struct {
	// Config describes the proxy and the node; see Config.
	Config Config
	// Runner runs iptables for Config.Family. Required.
	Runner Runner
	// Logger receives the manager's logs. The zero value logs nothing.
	Logger zerolog.Logger
	// InterfaceAddrs lists the node's addresses for Config.NodePortAddresses, on every sync.
	// Nil means InterfaceAddrs (net.InterfaceAddrs).
	InterfaceAddrs func() ([]netip.Addr, error)
	// Flows, if set, deletes the conntrack entries of UDP flows whose portal changed, after
	// each successful sync (see package portal/conntrack). Nil leaves them alone.
	Flows FlowDeleter
}

// Manager programs the portal rules of one IP family. Its methods may be called from several
// goroutines; calls are serialised.
type Manager struct {
	cfg    Config
	run    Runner
	log    zerolog.Logger
	ifaddr func() ([]netip.Addr, error)
	flows  FlowDeleter

	mu sync.Mutex // guards the following fields
	// physdevChecked and noPhysdev cache whether the kernel has the physdev match.
	physdevChecked bool
	noPhysdev      bool
	// synced is true after a successful Sync: our chains existed then, and jumps found missing
	// later were removed by someone else and are logged when put back.
	synced bool
	// written holds, per table, the rule lines the last successful Sync or Update left in our
	// chains; nil when unknown.
	written map[string][]string
	// udpTargets is what the last successful sync did with each UDP target (see
	// deleteStaleFlowsLocked); nil before the first.
	udpTargets map[udpTarget]string
}

// NewManager checks opts and returns a Manager. It changes nothing on the host.
func NewManager(opts Options) (*Manager, error) {
	cfg := opts.Config
	if opts.Runner == nil {
		return nil, errors.New("portal manager: no Runner")
	}
	if f := opts.Runner.Family(); f != cfg.Family {
		return nil, fmt.Errorf("portal manager: runner is %v, config is %v", f, cfg.Family)
	}
	if cfg.BindIP.IsValid() && !cfg.BindIP.IsUnspecified() && !inFamily(cfg.Family, cfg.BindIP) {
		return nil, fmt.Errorf("portal manager: bind IP %v is not %v", cfg.BindIP, cfg.Family)
	}
	if !cfg.BindIP.IsValid() || cfg.BindIP.IsUnspecified() {
		if !inFamily(cfg.Family, cfg.HostIP) || cfg.HostIP.IsUnspecified() {
			return nil, fmt.Errorf("portal manager: host IP %v: need an %v address of the node when the bind IP is unspecified", cfg.HostIP, cfg.Family)
		}
	}
	for _, p := range cfg.NodePortAddresses {
		if !p.IsValid() {
			return nil, fmt.Errorf("portal manager: nodePortAddresses: invalid prefix %v", p)
		}
	}
	m := &Manager{
		cfg:    cfg,
		run:    opts.Runner,
		log:    opts.Logger.With().Str("component", "portal").Str("family", cfg.Family.String()).Logger(),
		ifaddr: opts.InterfaceAddrs,
		flows:  opts.Flows,
	}
	if m.ifaddr == nil {
		m.ifaddr = InterfaceAddrs
	}
	return m, nil
}

// jump is a rule that sends packets from a built-in chain into one of ours.
type jump struct {
	table, from, to string
	pos             iptables.Position
	spec            []string
}

// jumps returns our jump rules in the order they must be ensured: of two rules both inserted
// first into one chain, the later one ends up on top.
func jumps() []jump {
	portals := []string{"-m", "comment", "--comment", "handle ClusterIPs; NOTE: this must be before the NodePort rules"}
	nodePorts := []string{"-m", "addrtype", "--dst-type", "LOCAL", "-m", "comment", "--comment", "handle service NodePorts; NOTE: this must be the last rule in the chain"}
	nonLocal := []string{"-m", "comment", "--comment", "Ensure that non-local NodePort traffic can flow"}
	filter := []string{"-m", "conntrack", "--ctstate", "NEW", "-m", "comment", "--comment", "reject or drop new traffic to service ports without usable endpoints"}
	j := func(table, from, to string, pos iptables.Position, matches []string) jump {
		return jump{table: table, from: from, to: to, pos: pos, spec: append(append([]string(nil), matches...), "-j", to)}
	}
	return []jump{
		j(tableNAT, "PREROUTING", ChainPortalsContainer, iptables.Prepend, portals),
		j(tableNAT, "OUTPUT", ChainPortalsHost, iptables.Prepend, portals),
		j(tableNAT, "PREROUTING", ChainNodePortContainer, iptables.Append, nodePorts),
		j(tableNAT, "OUTPUT", ChainNodePortHost, iptables.Append, nodePorts),
		j(tableFilter, "INPUT", ChainNodePortNonLocal, iptables.Prepend, nonLocal),
		j(tableFilter, "INPUT", ChainPortalsFilter, iptables.Prepend, filter),
		j(tableFilter, "FORWARD", ChainPortalsFilter, iptables.Prepend, filter),
		j(tableFilter, "OUTPUT", ChainPortalsFilter, iptables.Prepend, filter),
	}
}

// Sync makes our chains hold exactly the rules portals need, and makes sure our chains and the
// jumps into them exist, on every call: jumps or chains someone else deleted come back on the
// next sync. Jumps are checked first (while the chains may still be empty, inserting is cheap;
// afterwards checking costs one `iptables -S <built-in chain>` per built-in chain). Then each table is
// written with one iptables-restore, filter first so a NodePort's ACCEPT exists before nat sends
// traffic to it; rules and chains that are not ours are left alone. Invalid portals are left out
// and reported in the returned error together with any iptables failure; everything valid is
// still programmed.
func (m *Manager) Sync(portals []Portal) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.syncLocked(portals, true)
}

// Update is Sync for the syncs that changes trigger: it writes only the rules that differ from
// what the last successful Sync or Update wrote (deleting and appending single rules with
// iptables-restore --noflush, and not running it at all for a table with no change), and skips
// the jump checks. It thus costs in proportion to the change, not to the number of services,
// as kube-proxy's partial syncs do. It does a full Sync instead when no earlier one succeeded,
// and when writing the difference fails (someone else changed our chains): the periodic Sync
// repairs everything else.
//
// Rules of different portals never match the same packets (each names its own address, port
// and protocol), so appending a changed portal's rules after the others' is equivalent to the
// sorted order Sync writes.
func (m *Manager) Update(portals []Portal) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.syncLocked(portals, false)
}

func (m *Manager) syncLocked(portals []Portal, full bool) error {
	start := time.Now()
	var invalid, errs []error
	for i := range portals {
		if err := portals[i].Validate(); err != nil {
			invalid = append(invalid, err)
		}
	}
	host, err := m.hostLocked(portals)
	if err != nil {
		return errors.Join(append(invalid, err)...)
	}
	partial := !full && m.synced && m.written != nil
	if !partial {
		errs = append(errs, m.ensureJumpsLocked()...)
	}
	jumped := time.Now()

	nat, filter := Render(m.cfg, host, portals)
	rendered := time.Now()
	tables := []struct {
		table   string
		payload []byte
	}{{tableFilter, filter}, {tableNAT, nat}}
	if partial {
		written := map[string][]string{}
		var deltaBytes int
		for _, t := range tables {
			rules := ruleLines(t.payload)
			written[t.table] = rules
			delta := diffRules(m.written[t.table], rules)
			if len(delta) == 0 {
				continue
			}
			deltaBytes += len(delta)
			if err := m.run.Restore(t.table, delta); err != nil {
				m.log.Warn().Err(err).Str("table", t.table).Msg("writing the changed portal rules failed; rewriting all of them")
				m.synced = false
				return m.syncLocked(portals, true)
			}
		}
		m.written = written
		m.deleteStaleFlowsLocked(portals)
		m.log.Debug().Int("portals", len(portals)).Int("deltaBytes", deltaBytes).
			Dur("render", rendered.Sub(jumped)).Dur("restore", time.Since(rendered)).
			Dur("total", time.Since(start)).Msg("updated portal rules")
		return errors.Join(invalid...)
	}

	written := map[string][]string{}
	for _, t := range tables {
		if err := m.run.Restore(t.table, t.payload); err != nil {
			errs = append(errs, fmt.Errorf("portal sync: restore %s table: %w", t.table, err))
			continue
		}
		written[t.table] = ruleLines(t.payload)
	}
	// Until a sync succeeds, the next one checks every chain again and writes every rule.
	m.synced = len(errs) == 0
	m.written = nil
	if m.synced {
		m.written = written
		m.deleteStaleFlowsLocked(portals)
	}
	m.log.Debug().Int("portals", len(portals)).Int("natBytes", len(nat)).Int("filterBytes", len(filter)).
		Dur("jumps", jumped.Sub(start)).Dur("render", rendered.Sub(jumped)).Dur("restore", time.Since(rendered)).
		Dur("total", time.Since(start)).Msg("synced portal rules")
	return errors.Join(append(invalid, errs...)...)
}

// ruleLines returns the "-A chain ..." lines of a rendered payload.
func ruleLines(payload []byte) []string {
	lines := strings.Split(string(payload), "\n")
	rules := lines[:0]
	for _, l := range lines {
		if strings.HasPrefix(l, "-A ") {
			rules = append(rules, l)
		}
	}
	return rules
}

// diffRules returns the iptables-restore --noflush input that turns the rules was into the rules
// now: a "-D" line per rule only in was, then an "-A" line per rule only in now, in their
// order. It is empty when both hold the same rules (a rule's position within its chain does not
// matter: see Update).
func diffRules(was, now []string) []byte {
	count := make(map[string]int, len(was))
	for _, r := range was {
		count[r]++
	}
	var added []string
	for _, r := range now {
		if count[r] > 0 {
			count[r]--
		} else {
			added = append(added, r)
		}
	}
	var b []byte
	for _, r := range was {
		if count[r] > 0 {
			count[r]--
			b = append(append(append(b, "-D "...), r[len("-A "):]...), '\n')
		}
	}
	for _, r := range added {
		b = append(append(b, r...), '\n')
	}
	return b
}

// ensureJumpsLocked makes sure our chains and the jumps into them exist. Before the first
// successful sync it checks every chain; later a chain is only created when the jump to it
// cannot be checked (someone deleted the chain, and with it the jumps).
func (m *Manager) ensureJumpsLocked() []error {
	var errs []error
	if !m.synced {
		for _, t := range []struct {
			table  string
			chains []string
		}{{tableFilter, filterChains()}, {tableNAT, natChains()}} {
			for _, c := range t.chains {
				if err := m.run.EnsureChain(t.table, c); err != nil {
					errs = append(errs, fmt.Errorf("portal sync: %w", err))
				}
			}
		}
	}
	// One listing per built-in chain tells which jumps are there (cheap: with iptables-nft it
	// reads that chain only); only missing ones take the slower EnsureRule path.
	present := map[string]bool{}
	listed := map[string]bool{}
	for _, j := range jumps() {
		key := j.table + "/" + j.from
		if listed[key] {
			continue
		}
		listed[key] = true
		lines, err := m.run.List(j.table, j.from)
		if err != nil {
			continue // EnsureRule below reports what is wrong
		}
		for _, line := range lines {
			if args, err := iptables.SplitRule(line); err == nil && len(args) > 2 && args[0] == "-A" {
				present[key+" "+strings.Join(args[2:], "\x00")] = true
			}
		}
	}
	for _, j := range jumps() {
		if present[j.table+"/"+j.from+" "+strings.Join(j.spec, "\x00")] {
			continue
		}
		added, err := m.run.EnsureRule(j.pos, j.table, j.from, j.spec...)
		if err != nil {
			if cerr := m.run.EnsureChain(j.table, j.to); cerr == nil {
				added, err = m.run.EnsureRule(j.pos, j.table, j.from, j.spec...)
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("portal sync: jump %s/%s -> %s: %w", j.table, j.from, j.to, err))
			continue
		}
		if added && m.synced {
			m.log.Warn().Str("table", j.table).Str("chain", j.from).Str("target", j.to).Msg("jump rule was missing; restored")
		}
	}
	return errs
}

// hostLocked gathers the Host facts rendering needs.
func (m *Manager) hostLocked(portals []Portal) (Host, error) {
	var h Host
	if _, all := NodePortIPs(m.cfg.Family, m.cfg.NodePortAddresses, nil); !all {
		addrs, err := m.ifaddr()
		if err != nil {
			return h, fmt.Errorf("portal sync: node addresses for nodePortAddresses: %w", err)
		}
		h.NodeIPs = addrs
	}
	if !m.physdevChecked && hasExternalIPs(portals) {
		m.noPhysdev = !m.probePhysdevLocked()
		m.physdevChecked = true
	}
	h.NoPhysdev = m.noPhysdev
	return h, nil
}

func hasExternalIPs(portals []Portal) bool {
	for i := range portals {
		if len(portals[i].ExternalIPs) > 0 {
			return true
		}
	}
	return false
}

// probePhysdevLocked reports whether the kernel accepts a rule with the physdev match, by
// loading one into a scratch chain and deleting the chain again.
func (m *Manager) probePhysdevLocked() bool {
	payload := []byte(":" + chainProbe + " - [0:0]\n-A " + chainProbe + " -m physdev ! --physdev-is-in -j RETURN\n")
	err := m.run.Restore(tableNAT, payload)
	if derr := m.run.DeleteChain(tableNAT, chainProbe); derr != nil {
		m.log.Warn().Err(derr).Msg("could not delete the physdev probe chain")
	}
	if err != nil {
		m.log.Info().Err(err).Msg("physdev match (xt_physdev) not available: externalIP rules for traffic from containers match on destination only")
		return false
	}
	return true
}

// Cleanup removes every jump to our chains (from any built-in chain, whatever its matches, so
// rules of older versions and of kube-proxy's userspace mode go too) and then the chains. It is
// idempotent: with nothing there it does nothing and returns nil.
func (m *Manager) Cleanup() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	for _, t := range []struct {
		table  string
		hooks  []string
		chains []string
	}{
		{tableNAT, []string{"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"}, append(natChains(), chainProbe)},
		{tableFilter, []string{"INPUT", "FORWARD", "OUTPUT"}, filterChains()},
	} {
		for _, hook := range t.hooks {
			n, err := m.run.DeleteJumps(t.table, hook, t.chains...)
			if err != nil {
				errs = append(errs, fmt.Errorf("portal cleanup: %w", err))
			}
			if n > 0 {
				m.log.Info().Str("table", t.table).Str("chain", hook).Int("rules", n).Msg("deleted jump rules")
			}
		}
		for _, c := range t.chains {
			if err := m.run.DeleteChain(t.table, c); err != nil {
				errs = append(errs, fmt.Errorf("portal cleanup: %w", err))
			}
		}
	}
	m.synced, m.written, m.udpTargets = false, nil, nil
	return errors.Join(errs...)
}
