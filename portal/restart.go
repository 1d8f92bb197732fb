package portal

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// PortKey names a service port as its rules do: the comment (proxy.Name.String(), see
// Portal.Comment) and the protocol ("tcp" or "udp").
type PortKey struct {
	Name     string
	Protocol string
}

// KeyOf returns the PortKey of a service port.
func KeyOf(name proxy.Name, protocol v1.Protocol) PortKey {
	return PortKey{Name: name.String(), Protocol: strings.ToLower(string(protocol))}
}

// ProxyPorts maps service ports to the proxy port that rules of an earlier run name for them
// (Set.SurvivingProxyPorts).
type ProxyPorts map[PortKey]int

// Port returns the proxy port of a service port; 0 when the rules name none.
func (pp ProxyPorts) Port(name proxy.Name, protocol v1.Protocol) int {
	return pp[KeyOf(name, protocol)]
}

// Ports returns every proxy port in pp, sorted.
func (pp ProxyPorts) Ports() []int {
	out := make([]int, 0, len(pp))
	for _, p := range pp {
		out = append(out, p)
	}
	slices.Sort(out)
	return out
}

// SurvivingProxyPorts reads the rules of ours that an earlier run of the proxy left in every
// family the Set manages (NewSet keeps them, see there) and returns the proxy port they name
// for each service port: a restarted proxy that opens its listeners on these ports serves the
// old rules' traffic the moment a listener is open, before its first sync. A service port whose
// rules name several proxy ports, and a proxy port named by several service ports, are left out
// with a log line. It returns what it found in the families it could read, together with the
// errors of those it could not.
func (s *Set) SurvivingProxyPorts(ctx context.Context) (ProxyPorts, error) {
	var found []namedPort
	var errs []error
	for _, f := range s.families {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		ports, err := f.manager.namedProxyPorts(!s.prepared)
		if err != nil {
			errs = append(errs, fmt.Errorf("%v: %w", f.family, err))
		}
		found = append(found, ports...)
	}
	pp := survivors(found, s.log)
	if len(pp) > 0 {
		s.log.Info().Int("servicePorts", len(pp)).Msg("proxy ports named by the rules of an earlier run: reusing them")
	}
	return pp, errors.Join(errs...)
}

// namedPort is one rule's service port and the proxy port it names.
type namedPort struct {
	key  PortKey
	port int
}

// namedProxyPorts returns what the rules in the manager's family name (see scanProxyPorts).
// With keep, it keeps the listings for the first PruneStale, which thus reads no table again
// (see there why they are still true then). A successor's Set passes false: it never prunes
// (the running proxy's rules are about to become its own), so the listings (both tables, a
// few rule lines per service port) would stay for the life of the process; and the running
// proxy goes on writing rules after they were read.
func (m *Manager) namedProxyPorts(keep bool) ([]namedPort, error) {
	var out []namedPort
	saves := map[string][]byte{}
	for _, table := range []string{tableNAT, tableFilter} {
		save, err := m.run.Save(table)
		if err != nil {
			return out, fmt.Errorf("reading the surviving portal rules: %w", err)
		}
		saves[table] = save
		out = append(out, scanProxyPorts(save)...)
	}
	if keep {
		m.mu.Lock()
		m.startSaves = saves
		m.mu.Unlock()
	}
	return out, nil
}

// scanProxyPorts returns the service port and proxy port of each rule of ours in an
// iptables-save listing that names both: the REDIRECT (--to-ports) and DNAT (--to-destination)
// targets of the nat chains, and the guards of KUBE-PORTALS-PROXY-PORTS (--dport) that earlier
// versions wrote one per proxy port (now a guard lists up to 15 ports without naming them, so
// the proxy port of a service port without endpoints is not read back). Anything else, and
// anything it cannot read (port lists, garbled quoting, foreign chains), is skipped.
func scanProxyPorts(save []byte) []namedPort {
	var out []namedPort
	sc := bufio.NewScanner(bytes.NewReader(save))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		if np, ok := parseProxyPortRule(sc.Text()); ok {
			out = append(out, np)
		}
	}
	return out
}

// parseProxyPortRule reads one "-A CHAIN ..." line (see scanProxyPorts).
func parseProxyPortRule(line string) (namedPort, bool) {
	if !strings.HasPrefix(line, "-A ") {
		return namedPort{}, false
	}
	args, err := iptables.SplitRule(line)
	if err != nil || len(args) < 2 {
		return namedPort{}, false
	}
	opts := args[2:]
	key := PortKey{Name: ruleOption(opts, "--comment"), Protocol: ruleOption(opts, "-p")}
	switch key.Protocol { // constants, not substrings of line (which key.Name is until cloned below)
	case "tcp":
		key.Protocol = "tcp"
	case "udp":
		key.Protocol = "udp"
	default:
		return namedPort{}, false
	}
	if key.Name == "" {
		return namedPort{}, false
	}
	var port string
	switch chain, target := args[1], ruleOption(opts, "-j"); {
	case chain == ChainProxyPorts && target == "REJECT":
		port = ruleOption(opts, "--dport")
	case !slices.Contains(natChains(), chain):
		return namedPort{}, false
	case target == "REDIRECT":
		port = ruleOption(opts, "--to-ports")
	case target == "DNAT":
		ap, err := netip.ParseAddrPort(ruleOption(opts, "--to-destination"))
		if err != nil {
			return namedPort{}, false
		}
		port = strconv.Itoa(int(ap.Port()))
	}
	n, ok := parsePort(port)
	if !ok {
		return namedPort{}, false
	}
	key.Name = strings.Clone(key.Name) // kept: let line go
	return namedPort{key: key, port: n}, true
}

// ruleOption returns the value of option name ("-p", "--comment", "-j" for "--jump" too, ...)
// among a rule's arguments; of an option given twice, the first; "" when absent. A negated
// option ("! --dport 80") does not count. A scan per option, not a map per rule: a restart reads
// every rule of the tables.
func ruleOption(args []string, name string) string {
	for i := 0; i+1 < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") || strings.HasPrefix(args[i+1], "-") {
			continue
		}
		if (i == 0 || args[i-1] != "!") && (a == name || a == "--jump" && name == "-j") {
			return args[i+1]
		}
		i++
	}
	return ""
}

// parsePort parses a port number 1..65535 written in decimal digits only.
func parsePort(s string) (int, bool) {
	if s == "" || len(s) > 5 || strings.TrimLeft(s, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.Atoi(s)
	return n, err == nil && n >= 1 && n <= 65535
}

// survivors keeps, of what the rules name, each service port named with one proxy port that no
// other service port is named with; it logs the others.
func survivors(found []namedPort, log zerolog.Logger) ProxyPorts {
	byKey := map[PortKey][]int{}
	byPort := map[int][]PortKey{}
	for _, np := range found {
		if !slices.Contains(byKey[np.key], np.port) {
			byKey[np.key] = append(byKey[np.key], np.port)
		}
		if !slices.Contains(byPort[np.port], np.key) {
			byPort[np.port] = append(byPort[np.port], np.key)
		}
	}
	keys := make([]PortKey, 0, len(byKey))
	for k := range byKey {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b PortKey) int {
		return cmp.Or(strings.Compare(a.Name, b.Name), strings.Compare(a.Protocol, b.Protocol))
	})
	pp := ProxyPorts{}
	for _, k := range keys {
		ports := byKey[k]
		switch {
		case len(ports) > 1:
			slices.Sort(ports)
			log.Warn().Str("servicePort", k.Name).Str("protocol", k.Protocol).Ints("proxyPorts", ports).
				Msg("the rules of an earlier run name several proxy ports for this service port: it gets a new one")
		case len(byPort[ports[0]]) > 1:
			log.Warn().Str("servicePort", k.Name).Str("protocol", k.Protocol).Int("proxyPort", ports[0]).
				Int("servicePorts", len(byPort[ports[0]])).
				Msg("the rules of an earlier run name this service port's proxy port for other service ports too: it gets a new one")
		default:
			pp[k] = ports[0]
		}
	}
	return pp
}

// hookChains are the built-in chains, per table, that Cleanup and PruneStale look for jumps to
// our chains in.
func hookChains(table string) []string {
	if table == tableNAT {
		return []string{"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"}
	}
	return []string{"INPUT", "FORWARD", "OUTPUT"}
}

// PruneStale removes what an earlier run left that no Sync rewrites: jumps to our chains in a
// form other than the current one (older versions, kube-proxy's userspace mode), second copies
// of current jumps, and the physdev probe chain of older versions. Our chains and their rules
// stay: the proxy ports they name keep serving once a restarted proxy's listeners are open on
// them (Set.SurvivingProxyPorts), and the first Sync replaces their contents atomically, stale
// service ports included. A current jump stays where it is, unless a built-in chain holds a
// second copy of one: then its jumps to our chains are all put back in the order a fresh start
// gives them. It reads each table once (iptables-save; the first call uses what
// Set.SurvivingProxyPorts read, if it ran), and writes only when there is something to remove.
//
// The start's listings are as good as a fresh read (at 10,000 service ports each costs a few
// hundred milliseconds) because nothing of ours writes to nat or filter in between: a second
// proxy is kept out by the instance lock before any rule is read, and one started with a
// hand-over socket is a successor, whose Set neither keeps the listings nor prunes; this
// proxy's own start writes no rule before its first sync (the transparent routing, in mangle,
// comes after it). Another program changing our chains meanwhile is no different from one
// changing them right after a fresh read: a stale jump it adds stays until a restart, a
// deletion that finds its rule gone fails and falls back to removing all of ours (pruneStale),
// the first Sync lists the jumps again before it adopts anything, and a flushed chain shows at
// the next periodic Sync (intactLocked).
func (m *Manager) PruneStale() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	pruned := 0
	found := map[string][]byte{}
	for _, table := range []string{tableNAT, tableFilter} {
		n, rules, err := m.pruneTableLocked(table)
		pruned += n
		if err != nil {
			errs = append(errs, fmt.Errorf("portal prune: %w", err))
			found = nil
		} else if found != nil {
			found[table] = rules
		}
	}
	if pruned > 0 {
		m.log.Info().Int("rules", pruned).Msg("deleted jumps of an earlier version, or second copies")
	}
	m.synced, m.written, m.layout, m.input, m.udpTargets, m.startSaves = false, nil, nil, nil, nil, nil
	m.flowFailures, m.flowRetryAt = 0, time.Time{} // the next sync deletes every target's flows
	m.found = found
	return errors.Join(errs...)
}

// pruneTableLocked deletes the stale jumps of one table in one iptables-restore, puts back the
// current jumps of the built-in chains that had duplicates, deletes the probe chain, and
// returns how many jumps it deleted and the listing it read (our chains' rules are left alone).
func (m *Manager) pruneTableLocked(table string) (int, []byte, error) {
	save, ok := m.startSaves[table]
	delete(m.startSaves, table)
	if !ok {
		var err error
		if save, err = m.run.Save(table); err != nil {
			return 0, nil, err
		}
	}
	payload, n, rebuild, err := staleJumps(table, save)
	if err != nil {
		return 0, nil, err
	}
	if n > 0 {
		if err := m.run.Restore(table, payload); err != nil {
			return 0, nil, err
		}
	}
	for _, j := range jumps() {
		if j.table != table || !rebuild[j.from] {
			continue
		}
		if _, err := m.run.EnsureRule(j.pos, j.table, j.from, j.spec...); err != nil {
			return n, nil, fmt.Errorf("jump %s/%s -> %s: %w", j.table, j.from, j.to, err)
		}
	}
	if table == tableNAT && bytes.Contains(save, []byte("\n:"+chainProbe+" ")) {
		if err := m.run.DeleteChain(tableNAT, chainProbe); err != nil {
			return n, nil, err
		}
	}
	return n, save, nil
}

// staleJumps returns the iptables-restore input that deletes the stale jumps (see PruneStale)
// in an iptables-save listing of table, one "-D" line per rule, how many there are, and the
// built-in chains that hold a second copy of a current jump: of those, every jump to our
// chains is deleted ("-D" deletes the first copy, not the second), to be put back in order.
func staleJumps(table string, save []byte) ([]byte, int, map[string]bool, error) {
	ours := append(append(natChains(), filterChains()...), chainProbe)
	current := map[string]bool{}
	for _, j := range jumps() {
		if j.table == table {
			current[j.from+"\x00"+strings.Join(j.spec, "\x00")] = true
		}
	}
	stale := map[string][][]string{} // per hook
	kept := map[string][][]string{}  // per hook: the current jumps
	rebuild := map[string]bool{}
	seen := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(save))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "-A ") {
			continue
		}
		args, err := iptables.SplitRule(line)
		if err != nil {
			return nil, 0, nil, fmt.Errorf("%s: %w", table, err)
		}
		if len(args) < 2 || !slices.Contains(hookChains(table), args[1]) || !slices.Contains(ours, ruleTarget(args)) {
			continue
		}
		hook := args[1]
		key := hook + "\x00" + strings.Join(args[2:], "\x00")
		if !current[key] {
			stale[hook] = append(stale[hook], args[2:])
			continue
		}
		if seen[key] {
			rebuild[hook] = true
		}
		seen[key] = true
		kept[hook] = append(kept[hook], args[2:])
	}
	if err := sc.Err(); err != nil {
		return nil, 0, nil, fmt.Errorf("%s: %w", table, err)
	}
	var b []byte
	n := 0
	for _, hook := range hookChains(table) {
		del := stale[hook]
		if rebuild[hook] {
			del = append(del, kept[hook]...)
		}
		for _, spec := range del {
			b = append(b, "-D "+hook...)
			for _, a := range spec {
				b = append(append(b, ' '), iptables.Quote(a)...)
			}
			b = append(b, '\n')
		}
		n += len(del)
	}
	return b, n, rebuild, nil
}

// ruleTarget returns the argument of -j/--jump in args, or "".
func ruleTarget(args []string) string {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "-j" || args[i] == "--jump" {
			return args[i+1]
		}
	}
	return ""
}
