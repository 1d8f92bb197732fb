//go:build linux

package portal

import (
	"net/netip"
	"strings"
	"testing"
)

// TestAdoptInNamespace restarts a Manager over the rules of an earlier one: when they are the
// rules it would write (in Render's order, or with a partial update's rules in a recent chain)
// its first Sync writes nothing and its partial updates carry on from them; when they are not
// (a service changed meanwhile, a jump deleted) it writes everything; either way the next full
// Sync writes nothing.
func TestAdoptInNamespace(t *testing.T) { inEachBackend(t, testAdopt) }

func testAdopt(t *testing.T, b backend, ad addrs) {
	cfg := Config{Family: b.family, HostIP: ad.host, ClusterCIDRs: []netip.Prefix{pfx("10.244.0.0/16"), pfx("fd00:244::/48")}}
	web := Portal{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: ad.clusterIP, ProxyPort: 38023, NodePort: 30080,
		LoadBalancerIPs: []netip.Addr{ad.lbIP}}
	dns := Portal{Comment: "default/dns:dns", Protocol: "udp", Port: 53, ClusterIP: ad.clusterIP2, ProxyPort: 38053}
	db := Portal{Comment: "default/db:sql", Protocol: "tcp", Port: 5432, ClusterIP: ad.clusterIP2, ProxyPort: 38031}
	// wantRestores: the first Sync writes something; everything when wantRewrite, only the
	// difference otherwise.
	restart := func(what string, ps []Portal, wantRestores, wantRewrite bool) *restoreRecorder {
		t.Helper()
		rec := &restoreRecorder{Runner: mustRunner(t, b)}
		m, err := NewManager(Options{Config: cfg, Runner: rec})
		if err != nil {
			t.Fatal(err)
		}
		if err := m.PruneStale(); err != nil {
			t.Fatalf("%s: PruneStale: %v", what, err)
		}
		rec.restores = nil
		if err := m.Sync(ps, localIPs(t)); err != nil {
			t.Fatalf("%s: Sync: %v", what, err)
		}
		if got := len(rec.restores) > 0; got != wantRestores {
			t.Errorf("%s: first Sync wrote %d times, want writes: %v:\n%s", what, len(rec.restores), wantRestores, strings.Join(rec.restores, "\n"))
		}
		if got := strings.Contains(strings.Join(rec.restores, "\n"), ":"+ChainPortalsContainer+" "); got != wantRewrite {
			t.Errorf("%s: first Sync rewrote every rule: %v, want %v:\n%s", what, got, wantRewrite, strings.Join(rec.restores, "\n"))
		}
		nat, filter := Render(cfg, Host{}, ps)
		checkProgrammed(t, b, "nat", nat)
		checkFilterByGuardedPorts(t, b, filter)
		checkJumps(t, b)
		// The next full Sync (the first periodic one) finds the rules intact, whatever the
		// first wrote: no rewrite (with iptables-legacy, its check compares every rule).
		rec.restores = nil
		if err := m.Sync(ps, localIPs(t)); err != nil {
			t.Fatalf("%s: second Sync: %v", what, err)
		}
		if len(rec.restores) > 0 {
			t.Errorf("%s: the second full Sync wrote:\n%s", what, strings.Join(rec.restores, "\n"))
		}
		// Partial updates carry on: one more service, then one less, then the last one found
		// gone (in "rules in recent chains", its rules are in the recent chains), and back.
		rec.restores = nil
		more := append(ps[:len(ps):len(ps)], Portal{Comment: "default/more:x", Protocol: "tcp", Port: 81, ClusterIP: ad.clusterIP, ProxyPort: 38077})
		for _, now := range [][]Portal{more, ps, ps[:len(ps)-1], ps} {
			if err := m.Update(now, localIPs(t)); err != nil {
				t.Fatalf("%s: Update: %v", what, err)
			}
			nat, filter := Render(cfg, Host{}, now)
			checkProgrammed(t, b, "nat", nat)
			checkFilterByGuardedPorts(t, b, filter)
		}
		if strings.Contains(strings.Join(rec.restores, "\n"), ":"+ChainPortalsContainer) {
			t.Errorf("%s: a partial update after the first Sync rewrote everything:\n%s", what, strings.Join(rec.restores, "\n"))
		}
		return rec
	}

	first := &restoreRecorder{Runner: mustRunner(t, b)}
	m, err := NewManager(Options{Config: cfg, Runner: first})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Cleanup() })
	if err := m.Sync([]Portal{web, dns}, localIPs(t)); err != nil {
		t.Fatal(err)
	}
	// The same services: nothing to write.
	restart("same services", []Portal{web, dns}, false, false)
	// A partial update's rules in the recent chains: the same rules, nothing to write.
	if err := m.Update([]Portal{web, dns, db}, localIPs(t)); err != nil {
		t.Fatal(err)
	}
	restart("rules in recent chains", []Portal{web, dns, db}, false, false)
	// A service changed while no proxy ran (or its proxy port was taken meanwhile): its rules
	// are written, the others kept. Then one of those in a recent chain changed, one added,
	// one gone.
	web2 := web
	web2.ProxyPort = 38099
	restart("changed service", []Portal{web2, dns, db}, true, false)
	if err := m.Update([]Portal{web2, dns, db}, localIPs(t)); err != nil {
		t.Fatal(err)
	}
	db2, cache := db, Portal{Comment: "default/cache:redis", Protocol: "tcp", Port: 6379, ClusterIP: ad.clusterIP, ProxyPort: 38079}
	db2.ProxyPort = 38032
	restart("changed, added and gone", []Portal{web2, db2, cache}, true, false)
	restart("back", []Portal{web2, dns, db}, true, false)
	// A jump into our chains deleted: everything is written (and the jump put back).
	b.ipt(t, "-t", "nat", "-D", "OUTPUT", "-m", "comment", "--comment", "handle ClusterIPs; NOTE: this must be before the NodePort rules", "-j", ChainPortalsHost)
	restart("jump deleted", []Portal{web2, dns, db}, true, true)
	// A rule deleted from a chain: everything is written.
	b.ipt(t, "-t", "nat", "-F", recentChain(ChainPortalsHost))
	restart("recent chain flushed", []Portal{web2, dns, db}, true, true)
}
