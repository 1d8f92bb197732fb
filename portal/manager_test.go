//go:build linux

package portal

import (
	"errors"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"maps"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables/netnstest"
)

// backend is one iptables flavour the kernel tests run against.
type backend struct {
	family iptables.Family
	mode   iptables.Mode
}

func (b backend) cmd(suffix string) string {
	base := "iptables"
	if b.family == iptables.IPv6 {
		base = "ip6tables"
	}
	return base + "-" + string(b.mode) + suffix
}

func (b backend) String() string { return b.cmd("") }

var allBackends = []backend{
	{iptables.IPv4, iptables.ModeNFT}, {iptables.IPv4, iptables.ModeLegacy},
	{iptables.IPv6, iptables.ModeNFT}, {iptables.IPv6, iptables.ModeLegacy},
}

func requireBackends(t *testing.T) {
	t.Helper()
	var names []string
	for _, b := range allBackends {
		names = append(names, b.cmd(""), b.cmd("-save"), b.cmd("-restore"))
	}
	netnstest.RequireTools(t, "Debian package iptables ships both the -nft and the -legacy tools (iptables-legacy)", names...)
}

// ipt runs the backend's iptables in the calling thread's namespace.
func (b backend) ipt(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(b.cmd(""), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", b, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// save returns iptables-save for table, one line per element, without comments and counters.
func (b backend) save(t *testing.T, table string) []string {
	t.Helper()
	out, err := exec.Command(b.cmd("-save"), "-t", table).CombinedOutput()
	if err != nil {
		t.Fatalf("%s-save -t %s: %v: %s", b, table, err, out)
	}
	var lines []string
	for _, l := range strings.Split(string(out), "\n") {
		if l != "" && !strings.HasPrefix(l, "#") {
			lines = append(lines, l)
		}
	}
	return lines
}

// family-specific test addresses.
type addrs struct {
	host, node2, clusterIP, clusterIP2, extIP, lbIP netip.Addr
	nodeNet                                         netip.Prefix
}

func testAddrs(f iptables.Family) addrs {
	if f == iptables.IPv6 {
		return addrs{
			host: a("fd00:200::1"), node2: a("fd00:200::7"), clusterIP: a("fd00:96::10"), clusterIP2: a("fd00:96::20"),
			extIP: a("2001:db8::50"), lbIP: a("2001:db8:1::10"), nodeNet: pfx("fd00:200::/64"),
		}
	}
	return addrs{
		host: a("10.200.0.1"), node2: a("10.200.0.7"), clusterIP: a("10.96.0.10"), clusterIP2: a("10.96.0.20"),
		extIP: a("192.0.2.50"), lbIP: a("203.0.113.10"), nodeNet: pfx("10.200.0.0/24"),
	}
}

// countingRunner counts EnsureRule calls.
type countingRunner struct {
	*iptables.Runner
	ensureCalls int
	// jumpLines are the lines of restore payloads that add a rule to a built-in chain.
	jumpLines []string
	saves     int
}

func (c *countingRunner) Save(table string) ([]byte, error) {
	c.saves++
	return c.Runner.Save(table)
}

func (c *countingRunner) EnsureRule(pos iptables.Position, table, chain string, spec ...string) (bool, error) {
	c.ensureCalls++
	return c.Runner.EnsureRule(pos, table, chain, spec...)
}

func (c *countingRunner) Restore(table string, payload []byte) error {
	c.jumpLines = append(c.jumpLines, builtinRuleLines(payload)...)
	return c.Runner.Restore(table, payload)
}

func (c *countingRunner) RestoreTables(tables ...iptables.TablePayload) error {
	for _, t := range tables {
		c.jumpLines = append(c.jumpLines, builtinRuleLines(t.Payload)...)
	}
	return c.Runner.RestoreTables(tables...)
}

// builtinRuleLines returns the lines of a restore payload that add a rule to a built-in chain.
func builtinRuleLines(payload []byte) []string {
	var out []string
	for _, l := range strings.Split(string(payload), "\n") {
		f := strings.Fields(l)
		if len(f) >= 2 && (f[0] == "-A" || f[0] == "-I") && strings.ToUpper(f[1]) == f[1] && !strings.HasPrefix(f[1], "KUBE-") {
			out = append(out, l)
		}
	}
	return out
}

func mustRunner(t *testing.T, b backend) *iptables.Runner {
	t.Helper()
	r, err := iptables.New(iptables.Options{Family: b.family, Mode: b.mode})
	if err != nil {
		t.Fatalf("iptables.New: %v", err)
	}
	return r
}

func newTestManager(t *testing.T, b backend, cfg Config) (*Manager, *iptables.Runner) {
	t.Helper()
	r := mustRunner(t, b)
	m, err := NewManager(Options{Config: cfg, Runner: r})
	if err != nil {
		t.Fatalf("NewManager: %v", err)
	}
	return m, r
}

// TestManagerInNamespace programs a real kernel, in a namespace of its own per backend.
func TestManagerInNamespace(t *testing.T) { inEachBackend(t, testManager) }

// inEachBackend runs fn once per backend, inside a network namespace of its own that has the
// family's node addresses.
func inEachBackend(t *testing.T, fn func(t *testing.T, b backend, ad addrs)) {
	requireBackends(t)
	for _, b := range allBackends {
		t.Run(b.String(), func(t *testing.T) {
			ns := netnstest.New(t)
			ad := testAddrs(b.family)
			// Node addresses live on lo (this kernel has no dummy links).
			ns.IP(t, "addr", "add", netip.PrefixFrom(ad.host, ad.host.BitLen()).String(), "dev", "lo")
			ns.IP(t, "addr", "add", netip.PrefixFrom(ad.node2, ad.node2.BitLen()).String(), "dev", "lo")
			ns.Do(t, func() { fn(t, b, ad) })
		})
	}
}

func testManager(t *testing.T, b backend, ad addrs) {
	cfg := Config{Family: b.family, HostIP: ad.host}
	m, _ := newTestManager(t, b, cfg)

	// Cleanup with nothing there is fine.
	if err := m.Cleanup(); err != nil {
		t.Fatalf("Cleanup on a clean namespace: %v", err)
	}

	// Foreign rules and chains must survive everything we do.
	b.ipt(t, "-t", "nat", "-A", "PREROUTING", "-p", "udp", "--dport", "9", "-j", "ACCEPT")
	b.ipt(t, "-t", "nat", "-N", "FOREIGN")
	b.ipt(t, "-t", "nat", "-A", "FOREIGN", "-p", "tcp", "-j", "RETURN")
	b.ipt(t, "-t", "filter", "-A", "INPUT", "-p", "udp", "--dport", "9", "-j", "ACCEPT")
	foreign := []string{"-A PREROUTING -p udp -m udp --dport 9 -j ACCEPT", ":FOREIGN - [0:0]", "-A FOREIGN -p tcp -j RETURN"}

	portals := []Portal{
		{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: ad.clusterIP, ProxyPort: 38023, NodePort: 30080,
			ExternalIPs: []netip.Addr{ad.extIP}, LoadBalancerIPs: []netip.Addr{ad.lbIP}},
		{Comment: "default/dns:dns", Protocol: "udp", Port: 53, ClusterIP: ad.clusterIP2, Internal: proxy.Reject, External: proxy.Reject, NodePort: 30053},
	}
	sync := func(ps []Portal) {
		t.Helper()
		if err := m.Sync(ps, localIPs(t)); err != nil {
			t.Fatalf("Sync: %v", err)
		}
		nat, filter := Render(cfg, Host{}, ps)
		checkProgrammed(t, b, "nat", nat)
		checkProgrammed(t, b, "filter", filter)
		checkJumps(t, b)
		checkContains(t, b, "nat", foreign)
	}
	sync(portals)

	// In a steady state the jumps are found in the listings: no -C, no insert.
	counting := &countingRunner{Runner: mustRunner(t, b)}
	mc, err := NewManager(Options{Config: cfg, Runner: counting})
	if err != nil {
		t.Fatal(err)
	}
	mc.synced = true // as after an earlier successful sync of this manager
	if err := mc.Sync(portals, localIPs(t)); err != nil {
		t.Fatalf("Sync (counting): %v", err)
	}
	if counting.ensureCalls != 0 || len(counting.jumpLines) != 0 {
		t.Errorf("steady-state Sync called EnsureRule %d times and restored jumps %q, want none (jumps not recognised in iptables -S output)", counting.ensureCalls, counting.jumpLines)
	}

	// A change replaces the old rules.
	changed := slices.Clone(portals)
	changed[0].ProxyPort = 38099
	changed[0].ExternalIPs = nil
	sync(changed)
	for _, table := range []string{"nat", "filter"} {
		for _, l := range b.save(t, table) {
			if strings.Contains(l, "38023") || strings.Contains(l, ad.extIP.String()) {
				t.Errorf("after the change, %s still has %q", table, l)
			}
		}
	}

	// Someone deletes a jump, a rule and a whole chain of ours: the next sync puts them back.
	b.ipt(t, "-t", "nat", "-D", "PREROUTING", "-m", "comment", "--comment", "handle ClusterIPs; NOTE: this must be before the NodePort rules", "-j", ChainPortalsContainer)
	b.ipt(t, "-t", "filter", "-D", "FORWARD", "-m", "conntrack", "--ctstate", "NEW", "-m", "comment", "--comment", "reject or drop new traffic to service ports without usable endpoints", "-j", ChainPortalsFilter)
	b.ipt(t, "-t", "nat", "-D", ChainPortalsHost, "1")
	b.ipt(t, "-t", "nat", "-D", "OUTPUT", "-m", "addrtype", "--dst-type", "LOCAL", "-m", "comment", "--comment", "handle service NodePorts; NOTE: this must be the last rule in the chain", "-j", ChainNodePortHost)
	b.ipt(t, "-t", "nat", "-F", ChainNodePortHost)
	b.ipt(t, "-t", "nat", "-X", ChainNodePortHost)
	sync(changed)

	// NodePortAddresses: per-address rules for node addresses in the prefix only, read from the
	// namespace's interfaces.
	npCfg := Config{Family: b.family, HostIP: ad.host, NodePortAddresses: []netip.Prefix{netip.PrefixFrom(ad.node2, ad.node2.BitLen())}}
	m2, _ := newTestManager(t, b, npCfg)
	if err := m2.Sync(changed, localIPs(t)); err != nil {
		t.Fatalf("Sync with nodePortAddresses: %v", err)
	}
	nat := strings.Join(b.save(t, "nat"), "\n")
	wantNP := "-A KUBE-NODEPORT-CONTAINER -d " + netip.PrefixFrom(ad.node2, ad.node2.BitLen()).String() + " -p tcp"
	if !strings.Contains(nat, wantNP) || strings.Contains(nat, "-d "+netip.PrefixFrom(ad.host, ad.host.BitLen()).String()+" -p tcp -m comment --comment \"default/web:http\" -m tcp --dport 30080") {
		t.Errorf("nodePortAddresses %v: want NodePort rules for %v only:\n%s", npCfg.NodePortAddresses, ad.node2, nat)
	}

	// Cleanup removes everything of ours, leaves the rest, and can run again.
	for i := 0; i < 2; i++ {
		if err := m.Cleanup(); err != nil {
			t.Fatalf("Cleanup #%d: %v", i, err)
		}
		checkAbsent(t, b, "nat", "KUBE-")
		checkAbsent(t, b, "filter", "KUBE-")
		checkContains(t, b, "nat", foreign)
		checkContains(t, b, "filter", []string{"-A INPUT -p udp -m udp --dport 9 -j ACCEPT"})
	}
}

// checkProgrammed checks that every line Render produced is in iptables-save, verbatim, and that
// our chains hold nothing else but the jumps to the canary.
func checkProgrammed(t *testing.T, b backend, table string, payload []byte) {
	t.Helper()
	payload = withCanary(payload, chainsOf(table))
	want := foldRecent(strings.Split(strings.TrimSpace(string(payload)), "\n"))
	checkContains(t, b, table, want)
	ours := map[string]bool{}
	for _, c := range append(natChains(), filterChains()...) {
		ours[c] = true
	}
	wantSet := map[string]bool{}
	for _, l := range want {
		wantSet[l] = true
	}
	for _, l := range foldRecent(b.save(t, table)) {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "-A" && ours[f[1]] && !wantSet[l] {
			t.Errorf("%s: unexpected rule in our chain: %s", table, l)
		}
	}
}

// foldRecent returns rules with each recent chain's rules as rules of its chain (see
// recentChain), the jumps to recent chains and their canary jumps left out: the rules a partial
// update appended to a recent chain are then those a full Sync writes to the chain.
func foldRecent(rules []string) []string {
	var out []string
	for _, r := range rules {
		folded := false
		for _, c := range sectionChains {
			rc := recentChain(c)
			switch {
			case r == "-A "+c+" -j "+rc || r == canaryRule(rc):
				folded = true
			case strings.HasPrefix(r, "-A "+rc+" "):
				out, folded = append(out, "-A "+c+" "+r[len("-A "+rc+" "):]), true
			}
		}
		if !folded {
			out = append(out, r)
		}
	}
	return out
}

// checkFilterByGuardedPorts is checkProgrammed for the filter table after partial updates: the
// guards of KUBE-PORTALS-PROXY-PORTS may group the proxy ports otherwise than Render (see
// guardedDiff), so they are compared by the ports they guard, the other rules line by line.
func checkFilterByGuardedPorts(t *testing.T, b backend, payload []byte) {
	t.Helper()
	want := foldRecent(strings.Split(strings.TrimSpace(string(withCanary(payload, chainsOf("filter")))), "\n"))
	wantOther, wantGuards := splitGuards(want)
	checkContains(t, b, "filter", wantOther)
	var gotGuards []string
	for _, l := range foldRecent(b.save(t, "filter")) {
		f := strings.Fields(l)
		switch {
		case len(f) < 2 || f[0] != "-A" || !slices.Contains(filterChains(), f[1]):
		case f[1] == ChainProxyPorts && strings.Contains(l, " --dports "):
			gotGuards = append(gotGuards, l)
		case !slices.Contains(want, l):
			t.Errorf("filter: unexpected rule in our chain: %s", l)
		}
	}
	if got, w := guardPorts(t, gotGuards), guardPorts(t, wantGuards); !maps.EqualFunc(got, w, slices.Equal) {
		t.Errorf("filter: guards cover %v, want %v", got, w)
	}
}

func checkContains(t *testing.T, b backend, table string, want []string) {
	t.Helper()
	got := foldRecent(b.save(t, table))
	for _, w := range want {
		if !slices.Contains(got, w) {
			t.Errorf("%s-save -t %s lacks %q; has:\n%s", b, table, w, strings.Join(got, "\n"))
		}
	}
}

func checkAbsent(t *testing.T, b backend, table, substr string) {
	t.Helper()
	for _, l := range b.save(t, table) {
		if strings.Contains(l, substr) {
			t.Errorf("%s-save -t %s still has %q", b, table, l)
		}
	}
}

// checkJumps checks our jumps exist, portal jumps before NodePort jumps, NodePort jumps last.
func checkJumps(t *testing.T, b backend) {
	t.Helper()
	rulesOf := func(table, chain string) []string {
		var out []string
		for _, l := range b.save(t, table) {
			if strings.HasPrefix(l, "-A "+chain+" ") {
				out = append(out, l)
			}
		}
		return out
	}
	for _, c := range []struct{ chain, first, last string }{
		{"PREROUTING", ChainPortalsContainer, ChainNodePortContainer},
		{"OUTPUT", ChainPortalsHost, ChainNodePortHost},
	} {
		rules := rulesOf("nat", c.chain)
		if len(rules) < 2 || !strings.HasSuffix(rules[0], "-j "+c.first) || !strings.HasSuffix(rules[len(rules)-1], "-j "+c.last) ||
			!strings.Contains(rules[len(rules)-1], "-m addrtype --dst-type LOCAL") {
			t.Errorf("nat %s = %q: want the %s jump first and the %s jump (dst-type LOCAL) last", c.chain, rules, c.first, c.last)
		}
	}
	for _, c := range []struct {
		chain string
		want  []string
	}{
		{"INPUT", []string{ChainProxyPorts, ChainPortalsFilter, ChainNodePortNonLocal}},
		{"FORWARD", []string{ChainPortalsFilter}},
		{"OUTPUT", []string{ChainPortalsFilter}},
	} {
		rules := rulesOf("filter", c.chain)
		if len(rules) < len(c.want) {
			t.Errorf("filter %s = %q, want jumps to %v first", c.chain, rules, c.want)
			continue
		}
		for i, w := range c.want {
			if !strings.HasSuffix(rules[i], "-j "+w) {
				t.Errorf("filter %s rule %d = %q, want jump to %s", c.chain, i+1, rules[i], w)
			}
		}
		if !strings.Contains(rules[0], "--ctstate NEW") {
			t.Errorf("filter %s: reject/drop jump %q lacks --ctstate NEW", c.chain, rules[0])
		}
	}
}

// fakeRunner records calls and fails Restore for chosen tables; for Sync's error handling only.
type fakeRunner struct {
	failRestore map[string]bool
	restored    []string
	// jumpsIn are the tables whose restore payload added jumps into our chains.
	jumpsIn []string
	// listed is what List returns, by "table/chain"; ensured records EnsureRule calls.
	listed   map[string][]string
	ensured  []string
	payloads map[string]string
}

func (f *fakeRunner) Family() iptables.Family { return iptables.IPv4 }
func (f *fakeRunner) List(table, chain string) ([]string, error) {
	return f.listed[table+"/"+chain], nil
}
func (f *fakeRunner) Save(string) ([]byte, error) { return nil, nil }
func (f *fakeRunner) Mode() iptables.Mode         { return iptables.ModeNFT }
func (f *fakeRunner) References(string, string) (int, error) {
	return 0, errors.New("fake: no canary")
}
func (f *fakeRunner) EnsureRule(_ iptables.Position, table, chain string, spec ...string) (bool, error) {
	f.ensured = append(f.ensured, table+"/"+chain+"->"+spec[len(spec)-1])
	return false, nil
}
func (f *fakeRunner) DeleteJumps(string, string, ...string) (int, error) { return 0, nil }
func (f *fakeRunner) DeleteChain(string, string) error                   { return nil }
func (f *fakeRunner) Restore(table string, payload []byte) error {
	if len(builtinRuleLines(payload)) > 0 {
		f.jumpsIn = append(f.jumpsIn, table)
	}
	if f.payloads == nil {
		f.payloads = map[string]string{}
	}
	f.payloads[table] = string(payload)
	if f.failRestore[table] {
		return errors.New("restore " + table + " failed")
	}
	f.restored = append(f.restored, table)
	return nil
}

func TestSyncErrors(t *testing.T) {
	good := Portal{Comment: "a/good:p", Protocol: "tcp", Port: 80, ClusterIP: a("10.96.0.1"), ProxyPort: 1000}
	bad := Portal{Comment: "a/bad:p", Protocol: "sctp", Port: 80, ClusterIP: a("10.96.0.2"), ProxyPort: 1001}
	tests := []struct {
		name        string
		fail        map[string]bool
		portals     []Portal
		wantErr     []string
		wantRestore []string
		wantJumpsIn []string // tables whose restore added the (missing) jumps
	}{
		{name: "all fine", portals: []Portal{good}, wantRestore: []string{"filter", "nat"}, wantJumpsIn: []string{"filter", "nat"}},
		{name: "invalid portal reported, rest programmed", portals: []Portal{good, bad}, wantErr: []string{`"a/bad:p"`, "protocol"},
			wantRestore: []string{"filter", "nat"}, wantJumpsIn: []string{"filter", "nat"}},
		{name: "nat restore fails, filter still applied", fail: map[string]bool{"nat": true}, portals: []Portal{good},
			wantErr: []string{"restore nat", "nat table"}, wantRestore: []string{"filter"}, wantJumpsIn: []string{"filter", "nat"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeRunner{failRestore: tc.fail}
			m, err := NewManager(Options{Config: v4Config(), Runner: f})
			if err != nil {
				t.Fatal(err)
			}
			err = m.Sync(tc.portals, localIPs(t))
			if len(tc.wantErr) == 0 && err != nil {
				t.Fatalf("Sync = %v", err)
			}
			for _, w := range tc.wantErr {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Errorf("Sync error = %v, want it to mention %q", err, w)
				}
			}
			if !slices.Equal(f.restored, tc.wantRestore) {
				t.Errorf("restored %v, want %v", f.restored, tc.wantRestore)
			}
			tables := slices.Sorted(slices.Values(f.jumpsIn))
			if !slices.Equal(tables, tc.wantJumpsIn) {
				t.Errorf("jumps added in %v, want %v", tables, tc.wantJumpsIn)
			}
		})
	}
}

// A built-in chain that jumps to our chain in a form other than the one we print (another
// iptables version's) is left to EnsureRule (`iptables -C` judges equivalence) rather than
// given a second copy in the restore; jumps missing outright go into the restore.
func TestJumpInAnotherForm(t *testing.T) {
	f := &fakeRunner{listed: map[string][]string{
		"nat/PREROUTING": {"-A PREROUTING -m comment --comment \"handle ClusterIPs, printed otherwise\" -j " + ChainPortalsContainer},
	}}
	m, err := NewManager(Options{Config: v4Config(), Runner: f})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Sync([]Portal{{Comment: "a/b:p", Protocol: "tcp", Port: 80, ClusterIP: a("10.96.0.1"), ProxyPort: 1000}}, localIPs(t)); err != nil {
		t.Fatal(err)
	}
	if want := []string{"nat/PREROUTING->" + ChainPortalsContainer}; !slices.Equal(f.ensured, want) {
		t.Errorf("EnsureRule calls %q, want %q", f.ensured, want)
	}
	for _, l := range builtinRuleLines([]byte(f.payloads["nat"])) {
		if strings.HasPrefix(l, "-I PREROUTING") && strings.HasSuffix(l, ChainPortalsContainer) {
			t.Errorf("the nat restore adds %q beside the equivalent jump already there", l)
		}
	}
	if lines := builtinRuleLines([]byte(f.payloads["nat"])); len(lines) != 3 {
		t.Errorf("nat restore adds the jumps %q, want the other 3", lines)
	}
}

func TestNewManagerChecks(t *testing.T) {
	tests := []struct {
		name string
		opts Options
	}{
		{name: "no runner", opts: Options{Config: v4Config()}},
		{name: "family mismatch", opts: Options{Config: v6Config(), Runner: &fakeRunner{}}},
		{name: "no host IP with unspecified bind", opts: Options{Config: Config{Family: iptables.IPv4}, Runner: &fakeRunner{}}},
		{name: "host IP of other family", opts: Options{Config: Config{Family: iptables.IPv4, HostIP: a("fd00::1")}, Runner: &fakeRunner{}}},
		{name: "bind IP of other family", opts: Options{Config: Config{Family: iptables.IPv4, BindIP: a("fd00::1")}, Runner: &fakeRunner{}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NewManager(tc.opts); err == nil {
				t.Errorf("NewManager succeeded, want an error")
			}
		})
	}
	if _, err := NewManager(Options{Config: Config{Family: iptables.IPv4, BindIP: a("10.0.0.6")}, Runner: &fakeRunner{}}); err != nil {
		t.Errorf("bind IP without host IP: %v", err)
	}
}

// restoreRecorder records the payloads of Restore calls.
type restoreRecorder struct {
	*iptables.Runner
	restores []string // "table: payload"
	multi    int      // RestoreTables calls
}

func (r *restoreRecorder) Restore(table string, payload []byte) error {
	r.restores = append(r.restores, table+": "+string(payload))
	return r.Runner.Restore(table, payload)
}

// RestoreTables records each table as a restore of its own, and counts the execs.
func (r *restoreRecorder) RestoreTables(tables ...iptables.TablePayload) error {
	for _, t := range tables {
		r.restores = append(r.restores, t.Table+": "+string(t.Payload))
	}
	r.multi++
	return r.Runner.RestoreTables(tables...)
}

// TestManagerUpdateInNamespace checks partial updates on a real kernel: Update writes only the
// rules that changed, nothing when nothing did, and the chains always end up exactly as a full
// Sync would leave them, also after someone else removed a rule the update wants to delete.
func TestManagerUpdateInNamespace(t *testing.T) { inEachBackend(t, testUpdate) }

func testUpdate(t *testing.T, b backend, ad addrs) {
	cfg := Config{Family: b.family, HostIP: ad.host, ClusterCIDRs: []netip.Prefix{pfx("10.244.0.0/16"), pfx("fd00:244::/48")}}
	rec := &restoreRecorder{Runner: mustRunner(t, b)}
	m, err := NewManager(Options{Config: cfg, Runner: rec})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Cleanup() })
	web := Portal{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: ad.clusterIP, ProxyPort: 38023, NodePort: 30080,
		LoadBalancerIPs: []netip.Addr{ad.lbIP}}
	dns := Portal{Comment: "default/dns:dns", Protocol: "udp", Port: 53, ClusterIP: ad.clusterIP2, ProxyPort: 38053}
	update := func(what string, ps []Portal, wantRestores int, wantIn, wantNotIn string) {
		t.Helper()
		rec.restores = nil
		if err := m.Update(ps, localIPs(t)); err != nil {
			t.Fatalf("%s: Update: %v", what, err)
		}
		nat, filter := Render(cfg, Host{}, ps)
		checkProgrammed(t, b, "nat", nat)
		checkFilterByGuardedPorts(t, b, filter)
		checkJumps(t, b)
		if wantRestores >= 0 && len(rec.restores) != wantRestores {
			t.Errorf("%s: %d restores, want %d:\n%s", what, len(rec.restores), wantRestores, strings.Join(rec.restores, "\n"))
		}
		all := strings.Join(rec.restores, "\n")
		if wantIn != "" && !strings.Contains(all, wantIn) {
			t.Errorf("%s: restores lack %q:\n%s", what, wantIn, all)
		}
		if wantNotIn != "" && strings.Contains(all, wantNotIn) {
			t.Errorf("%s: restores have %q:\n%s", what, wantNotIn, all)
		}
	}

	// The first Update has nothing to compare with: a full sync, chains declared.
	update("first", []Portal{web}, 2, ":"+ChainPortalsContainer, "")
	// A new portal: only its rules are written: its portals in nat, its proxy port's guard in
	// filter.
	update("add dns", []Portal{web, dns}, 2, "-A "+ChainProxyPorts, "default/web:http")
	if rec.multi == 0 {
		t.Error("add dns: the partial update's two tables were written by one exec each, not one for both")
	}
	// Its portal rules went to the short recent chain, not to the long one.
	db := Portal{Comment: "default/db:sql", Protocol: "tcp", Port: 5432, ClusterIP: ad.clusterIP2, ProxyPort: 38031}
	update("add db", []Portal{web, dns, db}, 2, "-A "+recentChain(ChainPortalsContainer)+" ", "-A "+ChainPortalsContainer+" ")
	update("remove db", []Portal{web, dns}, 2, "-D "+recentChain(ChainPortalsContainer)+" ", "")
	// No change: no restore at all.
	update("no change", []Portal{web, dns}, 0, "", "")
	// A new proxy port in the block of web's (38010–38024): a guard of its own is appended,
	// web's is not deleted (a deletion makes iptables-nft read the whole chain).
	api := Portal{Comment: "default/api:http", Protocol: "tcp", Port: 443, ClusterIP: ad.clusterIP2, ProxyPort: 38024}
	update("add api", []Portal{web, dns, api}, 2, "--dports 38024 ", "-D "+ChainProxyPorts)
	// Its removal deletes that guard, and leaves the others.
	update("remove api", []Portal{web, dns}, 2, "-D "+ChainProxyPorts, "--dports 38023")
	// A changed proxy port: the old rules deleted, the new appended; dns untouched.
	web2 := web
	web2.ProxyPort = 38099
	update("change web", []Portal{web2, dns}, 2, "-D "+ChainPortalsContainer, "default/dns:dns")
	// Someone else deleted a rule the next update deletes: the partial write fails and the
	// manager falls back to writing everything.
	b.ipt(t, "-t", "nat", "-F", recentChain(ChainPortalsHost)) // where web2's rules are
	update("fallback", []Portal{dns}, -1, ":"+ChainPortalsContainer, "")
	// A periodic Sync, then Update keeps working from its state.
	if err := m.Sync([]Portal{dns}, localIPs(t)); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	update("after sync", []Portal{dns, web}, 2, "default/web:http", "default/dns:dns")
	// Local policy without a local endpoint: dropped from outside, redirected from pods.
	webDrop := web
	webDrop.External = proxy.Drop
	update("drop", []Portal{dns, webDrop}, 2, "-s ", "default/dns:dns")
}

// localIPs lists the addresses of the calling thread's network namespace, as a sync's snapshot
// of the node's addresses.
func localIPs(t testing.TB) []netip.Addr {
	t.Helper()
	a, err := proxy.ListNodeAddrs()
	if err != nil {
		t.Fatal(err)
	}
	return a.List()
}
