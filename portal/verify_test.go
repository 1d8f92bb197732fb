//go:build linux

package portal

import (
	"net/netip"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
)

// TestPeriodicSyncInNamespace checks, on a real kernel, that a Sync with nothing changed writes
// nothing, that one after someone flushed or deleted a chain of ours, or deleted a jump, leaves
// exactly the rules a fresh start leaves, and that every rule is rewritten after a partial
// write and once per rewrite period.
func TestPeriodicSyncInNamespace(t *testing.T) { inEachBackend(t, testPeriodicSync) }

func testPeriodicSync(t *testing.T, b backend, ad addrs) {
	cfg := Config{Family: b.family, HostIP: ad.host}
	rec := &restoreRecorder{Runner: mustRunner(t, b)}
	m, err := NewManager(Options{Config: cfg, Runner: rec})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Cleanup() })
	ps := []Portal{
		{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: ad.clusterIP, ProxyPort: 38023, NodePort: 30080,
			ExternalIPs: []netip.Addr{ad.extIP}, LoadBalancerIPs: []netip.Addr{ad.lbIP}},
		{Comment: "default/dns:dns", Protocol: "udp", Port: 53, ClusterIP: ad.clusterIP2, ProxyPort: 38053, NodePort: 30053},
	}
	sync := func(what string, sync func([]Portal, []netip.Addr) error, ps []Portal, wantRestores int) {
		t.Helper()
		rec.restores = nil
		if err := sync(ps, localIPs(t)); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if n := len(rec.restores); n != wantRestores {
			t.Errorf("%s: %d restores, want %d", what, n, wantRestores)
		}
	}
	sync("first sync", m.Sync, ps, 2)
	fresh := snapshot(t, b)
	sync("periodic sync, nothing changed", m.Sync, ps, 0)

	jumpTo := func(table, from, to string) []string {
		for _, j := range jumps() {
			if j.table == table && j.from == from && j.to == to {
				return append([]string{"-t", table, "-D", from}, j.spec...)
			}
		}
		t.Fatalf("no jump %s/%s -> %s", table, from, to)
		return nil
	}
	// Damage that a periodic sync repairs. The jumps deleted are those a re-insert puts back
	// where a fresh start has them (a prepended jump that was first, an appended one).
	type damage struct {
		name string
		cmds [][]string
	}
	var damages []damage
	for _, table := range []string{tableNAT, tableFilter} {
		for _, c := range chainsOf(table) {
			damages = append(damages, damage{"flush " + c, [][]string{{"-t", table, "-F", c}}})
		}
	}
	damages = append(damages,
		damage{"delete the first jump in filter INPUT", [][]string{jumpTo(tableFilter, "INPUT", ChainProxyPorts)}},
		damage{"delete the last jump in nat PREROUTING", [][]string{jumpTo(tableNAT, "PREROUTING", ChainNodePortContainer)}},
		damage{"delete chain " + ChainNodePortHost, [][]string{jumpTo(tableNAT, "OUTPUT", ChainNodePortHost),
			{"-t", tableNAT, "-F", ChainNodePortHost}, {"-t", tableNAT, "-X", ChainNodePortHost}}},
		damage{"delete chain " + ChainPortalsHost, [][]string{jumpTo(tableNAT, "OUTPUT", ChainPortalsHost),
			{"-t", tableNAT, "-F", ChainPortalsHost}, {"-t", tableNAT, "-X", ChainPortalsHost}}},
		damage{"flush the nat table", [][]string{{"-t", tableNAT, "-F"}, {"-t", tableNAT, "-X"}}},
	)
	for _, d := range damages {
		for _, cmd := range d.cmds {
			b.ipt(t, cmd...)
		}
		rec.restores = nil
		if err := m.Sync(ps, localIPs(t)); err != nil {
			t.Fatalf("after %s: Sync: %v", d.name, err)
		}
		if len(rec.restores) == 0 {
			t.Errorf("after %s: Sync wrote nothing", d.name)
		}
		checkSnapshot(t, b, "after "+d.name, fresh)
		sync("after the repair of "+d.name+", nothing changed", m.Sync, ps, 0)
	}

	// A rule deleted inside a chain: iptables-legacy's check (iptables-save) sees it, the canary
	// of iptables-nft does not; the rewrite of every rule once per period repairs it.
	b.ipt(t, "-t", tableNAT, "-D", ChainPortalsHost, "1")
	if b.mode == iptables.ModeLegacy {
		sync("legacy: after a rule was deleted inside a chain", m.Sync, ps, 2)
	} else {
		sync("nft: after a rule was deleted inside a chain", m.Sync, ps, 0)
		m.rewriteEvery = time.Nanosecond
		sync("nft: the rewrite period over", m.Sync, ps, 2)
		m.rewriteEvery = DefaultRewritePeriod
	}
	checkSnapshot(t, b, "after a rule was deleted inside a chain", fresh)

	// A partial write: the next Sync rewrites everything, in Render's order; an Update that
	// writes nothing does not count.
	moved := append([]Portal(nil), ps...)
	moved[1].ProxyPort = 38054
	sync("update", m.Update, moved, 2)
	sync("update back", m.Update, ps, 2)
	sync("sync after a partial write", m.Sync, ps, 2)
	checkSnapshot(t, b, "after a partial write and a sync", fresh)
	sync("update, nothing changed", m.Update, ps, 0)
	sync("sync after an update that wrote nothing", m.Sync, ps, 0)
	// Changed rules: a rewrite.
	sync("sync with a change", m.Sync, moved, 2)
	sync("sync back", m.Sync, ps, 2)
	checkSnapshot(t, b, "after changes and back", fresh)

	// Input that differs but renders the same rules (an invalid portal is left out): reported,
	// nothing written.
	rec.restores = nil
	bad := Portal{Comment: "default/bad:sctp", Protocol: "sctp", Port: 9, ClusterIP: ad.clusterIP, ProxyPort: 38999}
	if err := m.Sync(append(slices.Clone(ps), bad), localIPs(t)); err == nil || !strings.Contains(err.Error(), "sctp") {
		t.Errorf("Sync with an invalid portal = %v, want its error", err)
	}
	if len(rec.restores) != 0 {
		t.Errorf("Sync with an invalid portal added: %d restores, want 0", len(rec.restores))
	}

	// Options.RewritePeriod: with a short one every Sync rewrites.
	short, err := NewManager(Options{Config: cfg, Runner: rec, RewritePeriod: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	sync("short period: first", short.Sync, ps, 2)
	sync("short period: period over", short.Sync, ps, 2)
	checkSnapshot(t, b, "short period", fresh)
}

var counters = regexp.MustCompile(` \[\d+:\d+\]$`)

// snapshot returns iptables-save of nat and filter without comments and counters.
func snapshot(t *testing.T, b backend) string {
	t.Helper()
	var out []string
	for _, table := range []string{tableNAT, tableFilter} {
		for _, l := range b.save(t, table) {
			out = append(out, counters.ReplaceAllString(l, ""))
		}
	}
	return strings.Join(out, "\n")
}

// checkSnapshot checks that nat and filter hold exactly want (a snapshot).
func checkSnapshot(t *testing.T, b backend, what, want string) {
	t.Helper()
	if got := snapshot(t, b); got != want {
		t.Errorf("%s: the tables differ from a fresh start:\n got:\n%s\nwant:\n%s", what, got, want)
	}
}

// TestSyncInputReuse: every sync makes a digest of its portals; one of 10,000 allocates only
// its result (the hash and the encoding's buffer are reused), and a reused hash carries nothing
// of the digest before.
func TestSyncInputReuse(t *testing.T) {
	ps := scalePortals(10000)
	host := Host{NodeIPs: []netip.Addr{a("10.0.0.5")}}
	first := newSyncInput(ps, host)
	// Reused: one allocation, the result. Under the race detector sync.Pool drops a quarter of
	// what is Put, at random, and each drop costs a new hasher (three allocations): over 200
	// calls the average is then below 2 (1.75 expected), where no reuse at all costs 4 (measured).
	if raceBuild {
		if n := testing.AllocsPerRun(200, func() { newSyncInput(ps, host) }); n > 3 {
			t.Errorf("newSyncInput of 10,000 portals under the race detector: %v allocations on average, want at most 3 (the pool's random drops)", n)
		}
	} else if n := testing.AllocsPerRun(20, func() { newSyncInput(ps, host) }); n != 1 {
		t.Errorf("newSyncInput of 10,000 portals: %v allocations, want 1", n)
	}
	other := newSyncInput(ps[:5000], host)
	if other.same(first) || !newSyncInput(ps, host).same(first) {
		t.Error("digests of a reused hash differ from fresh ones")
	}
}

// TestSyncInputSeesEveryField changes each field of a Portal in turn, and of the Host: the
// digest must change with every one, or a periodic Sync would keep the rules of a changed portal
// until the next rewrite. Values that move between neighbouring fields, a portal split in two,
// an address of a list replaced, count too.
func TestSyncInputSeesEveryField(t *testing.T) {
	host := Host{NodeIPs: []netip.Addr{a("10.0.0.5")}}
	base := Portal{Comment: "a/b:c", Protocol: "tcp", Port: 80, ClusterIP: a("10.96.0.1"), ProxyPort: 40000,
		ExternalIPs: []netip.Addr{a("192.0.2.1")}, LoadBalancerSourceRanges: []netip.Prefix{netip.MustParsePrefix("198.51.100.0/24")}}
	in := newSyncInput([]Portal{base}, host)
	if !in.same(newSyncInput([]Portal{base}, Host{NodeIPs: []netip.Addr{a("10.0.0.5")}})) {
		t.Fatal("the digest of an input differs from that of a copy")
	}
	differs := func(what string, portals []Portal, host Host) {
		t.Helper()
		if in.same(newSyncInput(portals, host)) {
			t.Errorf("the digest misses a change of %s", what)
		}
	}
	typ := reflect.TypeOf(base)
	for i := range typ.NumField() {
		changed := base
		f := reflect.ValueOf(&changed).Elem().Field(i)
		switch f.Kind() {
		case reflect.String:
			f.SetString(f.String() + "x")
		case reflect.Int:
			f.SetInt(f.Int() + 1)
		case reflect.Slice:
			f.Set(reflect.Append(reflect.Zero(f.Type()), reflect.Zero(f.Type().Elem())))
		default:
			if f.Type() != reflect.TypeOf(netip.Addr{}) {
				t.Fatalf("field %s: kind %v: teach this test to change it", typ.Field(i).Name, f.Kind())
			}
			f.Set(reflect.ValueOf(a("10.96.0.2")))
		}
		differs(typ.Field(i).Name, []Portal{changed}, host)
	}
	moved := base
	moved.Comment, moved.Protocol = "a/b:ct", "cp"
	differs("a byte moved from one string to the next", []Portal{moved}, host)
	replaced := base
	replaced.ExternalIPs = []netip.Addr{a("192.0.2.2")}
	differs("an external IP replaced", []Portal{replaced}, host)
	narrower := base
	narrower.LoadBalancerSourceRanges = []netip.Prefix{netip.MustParsePrefix("198.51.100.0/25")}
	differs("a source range's length", []Portal{narrower}, host)
	differs("a second portal", []Portal{base, base}, host)
	differs("no portal", nil, host)
	differs("the node IPs", []Portal{base}, Host{NodeIPs: []netip.Addr{a("10.0.0.6")}})
	if (*syncInput)(nil).same(in) || in.same(nil) {
		t.Error("a nil digest (no input known) is the same as one")
	}
}
