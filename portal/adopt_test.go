package portal

import (
	"net/netip"
	"strings"
	"testing"
)

// TestAdoptInNamespace restarts a Manager over the rules of an earlier one: when they are the
// rules it would write (in Render's order, or with a partial update's rules in a recent chain)
// its first Sync writes nothing and its partial updates carry on from them; when they are not
// (a service changed meanwhile, a jump deleted) it writes everything.
func TestAdoptInNamespace(t *testing.T) { inEachBackend(t, testAdopt) }

func testAdopt(t *testing.T, b backend, ad addrs) {
	cfg := Config{Family: b.family, HostIP: ad.host, ClusterCIDRs: []netip.Prefix{pfx("10.244.0.0/16"), pfx("fd00:244::/48")}}
	web := Portal{Comment: "default/web:http", Protocol: "tcp", Port: 80, ClusterIP: ad.clusterIP, ProxyPort: 38023, NodePort: 30080,
		LoadBalancerIPs: []netip.Addr{ad.lbIP}}
	dns := Portal{Comment: "default/dns:dns", Protocol: "udp", Port: 53, ClusterIP: ad.clusterIP2, ProxyPort: 38053}
	db := Portal{Comment: "default/db:sql", Protocol: "tcp", Port: 5432, ClusterIP: ad.clusterIP2, ProxyPort: 38031}
	restart := func(what string, ps []Portal, wantRestores bool) *restoreRecorder {
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
		nat, filter := Render(cfg, Host{}, ps)
		checkProgrammed(t, b, "nat", nat)
		checkFilterByGuardedPorts(t, b, filter)
		checkJumps(t, b)
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
	restart("same services", []Portal{web, dns}, false)
	// A partial update's rules in the recent chains: the same rules, nothing to write.
	if err := m.Update([]Portal{web, dns, db}, localIPs(t)); err != nil {
		t.Fatal(err)
	}
	restart("rules in recent chains", []Portal{web, dns, db}, false)
	// A service changed while no proxy ran: everything is written.
	web2 := web
	web2.ProxyPort = 38099
	restart("changed service", []Portal{web2, dns, db}, true)
	// A jump into our chains deleted: everything is written (and the jump put back).
	b.ipt(t, "-t", "nat", "-D", "OUTPUT", "-m", "comment", "--comment", "handle ClusterIPs; NOTE: this must be before the NodePort rules", "-j", ChainPortalsHost)
	restart("jump deleted", []Portal{web2, dns, db}, true)
	// A rule deleted from a chain: everything is written.
	b.ipt(t, "-t", "nat", "-F", recentChain(ChainPortalsHost))
	restart("recent chain flushed", []Portal{web2, dns, db}, true)
}
