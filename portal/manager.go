package portal

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal/transparent"
)

// Runner is what a Manager needs from an iptables runner (*iptables.Runner): what the reply
// routing of transparent connections needs, and chains to create and list.
type Runner interface {
	transparent.Runner
	// List returns a chain's rules as `iptables -S` prints them.
	List(table, chain string) ([]string, error)
	// Save returns a table as iptables-save prints it.
	Save(table string) ([]byte, error)
	// Mode is the backend: the cheapest check that our rules are intact differs.
	Mode() iptables.Mode
	// References returns how many rules jump to a chain.
	References(table, chain string) (int, error)
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
	// Flows, if set, deletes the conntrack entries of UDP flows whose portal changed, after
	// each successful sync, in one call per sync (see package portal/conntrack, whose Tool
	// bounds the time a deletion may take). Nil leaves them alone.
	Flows FlowDeleter
	// RewritePeriod is the longest a Manager goes without rewriting every rule: a Sync in
	// between that finds its rules unchanged and intact writes nothing (see Sync). Zero means
	// DefaultRewritePeriod.
	RewritePeriod time.Duration
}

// Manager programs the portal rules of one IP family. Its methods may be called from several
// goroutines; calls are serialised.
type Manager struct {
	cfg   Config
	run   Runner
	log   zerolog.Logger
	flows FlowDeleter
	// rewriteEvery is Options.RewritePeriod.
	rewriteEvery time.Duration

	mu sync.Mutex // guards the following fields
	// synced is true after a successful Sync: our chains existed then, and jumps found missing
	// later were removed by someone else and are logged when put back.
	synced bool
	// written holds, per table, the rule lines the last successful Sync or Update left in our
	// chains; nil when unknown.
	written map[string][]string
	// layout is what each portal contributed to written (see planByPortal); nil when unknown.
	layout *layout
	// input is what Render was given for the rules in written; nil when unknown.
	input *syncInput
	// rewritten is when the last full write of every rule succeeded; zero when one failed or a
	// partial write (Update) came since.
	rewritten time.Time
	// udpTargets is what the last successful sync did with each UDP target (see
	// deleteStaleFlowsLocked); nil before the first.
	udpTargets map[netip.AddrPort]string
	// flowFailures counts the deletions of stale UDP flows that failed in a row; flowRetryAt is
	// when the next is due (see deleteStaleFlowsLocked).
	flowFailures int
	flowRetryAt  time.Time
	// found holds, per table, the iptables-save listing PruneStale read, for the first Sync to
	// compare our chains in it with what it would write (see adoptLocked); nil after that Sync.
	found map[string][]byte
	// startSaves holds the iptables-save listings namedProxyPorts read at start, per table, for
	// PruneStale to use instead of reading each table again (at 10,000 services a listing of
	// a table takes a few hundred milliseconds); taken by the first PruneStale.
	startSaves map[string][]byte
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
		cfg:          cfg,
		run:          opts.Runner,
		log:          opts.Logger.With().Str("component", "portal").Str("family", cfg.Family.String()).Logger(),
		flows:        opts.Flows,
		rewriteEvery: opts.RewritePeriod,
	}
	if m.rewriteEvery <= 0 {
		m.rewriteEvery = DefaultRewritePeriod
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
	proxyPorts := []string{"-m", "conntrack", "--ctstate", "NEW", "-m", "comment", "--comment", "refuse new traffic to proxy ports that no portal redirected"}
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
		j(tableFilter, "INPUT", ChainProxyPorts, iptables.Prepend, proxyPorts),
	}
}

// Sync makes our chains hold exactly the rules portals need, and makes sure our chains and the
// jumps into them exist: jumps someone else deleted, and chains someone flushed or deleted, come
// back on the next sync (a rule deleted inside a chain, with iptables-nft, at the next rewrite).
//
// It rewrites every rule when there is reason to: on the first sync, after a failed one or a
// partial write (Update), when the rules differ from what it last wrote, when someone changed
// ours (see intactLocked), and at least once per Options.RewritePeriod. A rewrite checks the
// jumps first (one `iptables -S <built-in chain>` each; missing ones are inserted) and then
// writes each table with one iptables-restore, filter first so a NodePort's ACCEPT exists
// before nat sends traffic to it; rules and chains that are not ours are left alone. Otherwise,
// the periodic case with nothing changed, it only checks that our rules are in place, a few
// cheap listings, and writes nothing: at 10,000 services that is a small fraction of a
// rewrite's cost. Each of our chains ends in a jump to the canary chain (KUBE-PORTALS-CANARY)
// for that check.
//
// Invalid portals are left out and reported in the returned error together with any iptables
// failure; everything valid is still programmed.
//
// nodeIPs are the node's addresses (any family), for Config.NodePortAddresses; the caller takes
// one snapshot per sync and hands it to every family's Manager.
func (m *Manager) Sync(portals []Portal, nodeIPs []netip.Addr) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.syncLocked(portals, nodeIPs, true)
}

// Update is Sync for the syncs that changes trigger: it writes only the rules that differ from
// what the last successful Sync or Update wrote (deleting and appending single rules with
// iptables-restore --noflush, and not running it at all for a table with no change), and skips
// the jump checks. It thus costs in proportion to the change, not to the number of services,
// as kube-proxy's partial syncs do. It does a full Sync instead when no earlier one succeeded,
// and when writing the difference fails (someone else changed our chains): the periodic Sync
// repairs everything else. The next Sync after an Update that wrote something rewrites every
// rule, in Render's order.
//
// Rules of different portals never match the same packets (each names its own address, port
// and protocol), so appending a changed portal's rules after the others' is equivalent to the
// sorted order Sync writes. The guards of KUBE-PORTALS-PROXY-PORTS are changed by the ports they
// list, so that a new proxy port appends a rule rather than replacing its block's (see
// guardedDiff): they guard the same ports as Render's, grouped otherwise until the next Sync.
func (m *Manager) Update(portals []Portal, nodeIPs []netip.Addr) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.syncLocked(portals, nodeIPs, false)
}

// table is one table's iptables-restore input.
type table struct {
	table   string
	payload []byte
}

func (m *Manager) syncLocked(portals []Portal, nodeIPs []netip.Addr, full bool) error {
	start := time.Now()
	var invalid []error
	for i := range portals {
		if err := portals[i].Validate(); err != nil {
			invalid = append(invalid, err)
		}
	}
	host := Host{NodeIPs: nodeIPs}
	// What Render was last given for the rules written: the same rules again, no need to render.
	in := newSyncInput(portals, host)
	same := m.synced && m.written != nil && m.input.same(in)
	if same && !full {
		m.retryFlowsLocked(portals, host.NodeIPs)
		m.log.Debug().Int("portals", len(portals)).Dur("total", time.Since(start)).Msg("portal rules unchanged")
		return errors.Join(invalid...)
	}
	if same && m.keepLocked(portals, host, in, start) {
		return errors.Join(invalid...)
	}
	order := renderOrder(portals)
	if !full && m.synced && m.written != nil {
		if done, err := m.updateByPortalLocked(portals, order, host, in, start); done {
			return errors.Join(append(invalid, err)...)
		}
	}
	tables, lay := m.renderLocked(host, order)
	if !full && m.synced && m.written != nil {
		return errors.Join(append(invalid, m.updateLocked(portals, host, in, tables, lay, start))...)
	}
	if !same && full && m.sameRulesLocked(tables) && m.keepLocked(portals, host, in, start) {
		m.layout = lay // the same rules, from portals that differ in what does not show in them
		return errors.Join(invalid...)
	}
	found := m.found
	m.found = nil
	if full {
		if done, err := m.adoptLocked(found, portals, order, host, in, tables, lay, start); done {
			return errors.Join(append(invalid, err)...)
		}
	}
	return errors.Join(append(invalid, m.rewriteLocked(portals, host, in, tables, lay, start)...)...)
}

// keepLocked is the periodic Sync with nothing to write: when no rewrite is due (see Sync) and
// our rules are intact, it remembers the input and returns true; otherwise the caller rewrites.
func (m *Manager) keepLocked(portals []Portal, host Host, in *syncInput, start time.Time) bool {
	if m.rewriteDueLocked() {
		return false
	}
	checked := time.Now()
	ok, why := m.intactLocked()
	if !ok {
		m.log.Warn().Str("reason", why).Msg("portal rules were changed by someone else; rewriting all of them")
		return false
	}
	if !m.input.same(in) {
		m.input = in
		m.deleteStaleFlowsLocked(portals, host.NodeIPs)
	} else {
		m.retryFlowsLocked(portals, host.NodeIPs)
	}
	m.log.Debug().Int("portals", len(portals)).Dur("check", time.Since(checked)).
		Dur("total", time.Since(start)).Msg("portal rules unchanged and in place")
	return true
}

// updateLocked writes the difference between what was written and tables (see Update), or
// everything when that fails.
func (m *Manager) updateLocked(portals []Portal, host Host, in *syncInput, tables []table, lay *layout, start time.Time) error {
	rendered := time.Now()
	written := map[string][]string{}
	var deltaBytes int
	for _, t := range tables {
		rules := ruleLines(t.payload)
		var delta []byte
		if t.table == tableFilter {
			delta, rules = guardedDiff(m.written[t.table], rules)
		} else {
			delta = diffRules(m.written[t.table], rules)
		}
		written[t.table] = rules
		if len(delta) == 0 {
			continue
		}
		deltaBytes += len(delta)
		m.rewritten = time.Time{} // the next Sync rewrites, in Render's order
		restoreStart := time.Now()
		err := m.run.Restore(t.table, delta)
		m.log.Debug().Str("table", t.table).Int("deltaBytes", len(delta)).Dur("took", time.Since(restoreStart)).Msg("wrote changed portal rules")
		if err != nil {
			m.log.Warn().Err(err).Str("table", t.table).Msg("writing the changed portal rules failed; rewriting all of them")
			m.synced = false
			return errors.Join(m.rewriteLocked(portals, host, in, tables, lay, start)...)
		}
	}
	m.written, m.input, m.layout = written, in, lay
	m.deleteStaleFlowsLocked(portals, host.NodeIPs)
	m.log.Debug().Int("portals", len(portals)).Int("deltaBytes", deltaBytes).
		Dur("restore", time.Since(rendered)).Dur("total", time.Since(start)).Msg("updated portal rules")
	return nil
}

// rewriteLocked writes every rule of tables, one iptables-restore per table: the payload
// declares our chains (creating or flushing them) and adds the jumps into them that are
// missing. Finding those takes one listing per built-in chain; before, a fresh start spent about
// 50 iptables execs (0.8 s with iptables-nft) creating chains and inserting jumps one at a time.
func (m *Manager) rewriteLocked(portals []Portal, host Host, in *syncInput, tables []table, lay *layout, start time.Time) []error {
	rendered := time.Now()
	missing := m.missingJumpsLocked()
	jumped := time.Now()
	var errs []error
	written := map[string][]string{}
	for _, t := range tables {
		payload := t.payload
		if add := missing[t.table]; len(add) > 0 {
			payload = append(slices.Clip(payload), add...)
		}
		if err := m.run.Restore(t.table, payload); err != nil {
			errs = append(errs, fmt.Errorf("portal sync: restore %s table: %w", t.table, err))
			continue
		}
		written[t.table] = ruleLines(t.payload)
		if len(missing[t.table]) > 0 && m.synced {
			m.log.Warn().Str("table", t.table).Str("rules", strings.TrimSpace(string(missing[t.table]))).Msg("jump rules were missing; restored")
		}
	}
	// Until a sync succeeds, the next one checks every chain again and writes every rule.
	m.synced = len(errs) == 0
	m.written, m.layout, m.input, m.rewritten = nil, nil, nil, time.Time{}
	if m.synced {
		m.written, m.layout, m.input, m.rewritten = written, lay, in, start
		m.deleteStaleFlowsLocked(portals, host.NodeIPs)
	}
	m.log.Debug().Int("portals", len(portals)).Int("natBytes", len(tables[1].payload)).Int("filterBytes", len(tables[0].payload)).
		Dur("render", rendered.Sub(start)).Dur("jumps", jumped.Sub(rendered)).Dur("restore", time.Since(jumped)).
		Dur("total", time.Since(start)).Msg("synced portal rules")
	return errs
}

// missingJumpsLocked returns, per table, the iptables-restore lines that add the jumps into our
// chains that the built-in chains lack, in jumps() order (so the result is the one inserting
// them one at a time gives: of two jumps prepended to one chain, the later ends up first). A
// jump not found as we print it, where the chain holds another jump to the same target, is left
// to EnsureRule (`iptables -C` recognises equivalent forms).
func (m *Manager) missingJumpsLocked() map[string][]byte {
	present := m.listJumpsLocked()
	out := map[string][]byte{}
	for _, j := range jumps() {
		if present[jumpKey(j.table, j.from, j.spec)] {
			continue
		}
		if present[targetKey(j.table, j.from, j.to)] {
			// A jump to the chain is there, printed otherwise than we write it (another
			// iptables version, say): let `iptables -C` judge, so that no rewrite adds a
			// second copy of an equivalent rule.
			if _, err := m.run.EnsureRule(j.pos, j.table, j.from, j.spec...); err != nil {
				m.log.Warn().Err(err).Str("table", j.table).Str("chain", j.from).Str("target", j.to).Msg("checking a jump rule")
			}
			continue
		}
		line := "-A " + j.from + " "
		if j.pos == iptables.Prepend {
			line = "-I " + j.from + " 1 "
		}
		out[j.table] = append(append(append(out[j.table], line...), iptables.JoinRule(j.spec)...), '\n')
	}
	return out
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
	// The rules both start and end with are in both: only the middle needs counting. (Both are
	// mostly in Render's order, so one more or one less portal leaves a middle of a few rules:
	// at 10,000 portals this spares hashing every rule of the table on each partial sync.)
	for len(was) > 0 && len(now) > 0 && was[0] == now[0] {
		was, now = was[1:], now[1:]
	}
	for len(was) > 0 && len(now) > 0 && was[len(was)-1] == now[len(now)-1] {
		was, now = was[:len(was)-1], now[:len(now)-1]
	}
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

// listJumpsLocked returns the rules of the built-in chains we jump from, keyed by jumpKey: one
// listing per chain (cheap: with iptables-nft it reads that chain only). A chain that cannot be
// listed contributes nothing.
func (m *Manager) listJumpsLocked() map[string]bool {
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
			continue
		}
		for _, line := range lines {
			if args, err := iptables.SplitRule(line); err == nil && len(args) > 2 && args[0] == "-A" {
				present[jumpKey(j.table, j.from, args[2:])] = true
				present[targetKey(j.table, j.from, ruleTarget(args))] = true
			}
		}
	}
	return present
}

// targetKey is the key under which listJumpsLocked notes that a built-in chain holds some rule
// jumping to target.
func targetKey(table, from, target string) string { return "->" + table + "/" + from + "/" + target }

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
		{tableNAT, hookChains(tableNAT), append(natChains(), chainProbe, chainCanary)},
		{tableFilter, hookChains(tableFilter), append(filterChains(), chainCanary)},
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
	m.synced, m.written, m.layout, m.input, m.rewritten, m.udpTargets, m.found = false, nil, nil, nil, time.Time{}, nil, nil
	m.flowFailures, m.flowRetryAt = 0, time.Time{} // the next sync deletes every target's flows
	return errors.Join(errs...)
}
