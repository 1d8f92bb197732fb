package loadbalancer

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"
)

// Entries handed to a new balancer keep every client on its endpoint, in both pools; entries of
// an endpoint that left, or expired ones, are dropped; the order of use survives (the bound then
// evicts the same client the old balancer would have).
func TestAffinityHandOver(t *testing.T) {
	n := name("svc", "http")
	sp := svcPort(n, withAffinity(time.Minute), externalLocal)
	eps := []string{"10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"}
	old := newHarness(t, thisNode, 1)
	old.set(sp, ready(eps[0], thisNode), ready(eps[1], thisNode), ready(eps[2], "other"))
	want := map[string]string{}
	for i := range 30 {
		client := fmt.Sprintf("192.0.2.%d", i+1)
		want[client] = old.next(n, client, i%2 == 0, false).Addr.String()
		old.clock.Advance(time.Second)
	}
	entries := old.lb.Affinity()
	if len(entries) != 30 {
		t.Fatalf("%d entries exported, want 30", len(entries))
	}
	for i := 1; i < len(entries); i++ {
		if entries[i].Idle > entries[i-1].Idle {
			t.Fatalf("entries not oldest first: %v then %v", entries[i-1].Idle, entries[i].Idle)
		}
	}
	// Through JSON, as the hand-over carries them.
	b, err := json.Marshal(entries)
	if err != nil {
		t.Fatal(err)
	}
	var got []AffinityEntry
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}

	// A different rotation start: without the entries most clients would move.
	fresh := newHarness(t, thisNode, 99)
	fresh.lb.RestoreAffinity(got)
	fresh.set(sp, ready(eps[0], thisNode), ready(eps[1], thisNode), ready(eps[2], "other"))
	for i := range 30 {
		client := fmt.Sprintf("192.0.2.%d", i+1)
		if ep := fresh.next(n, client, i%2 == 0, false).Addr.String(); ep != want[client] {
			t.Errorf("client %s: %s after the hand-over, %s before", client, ep, want[client])
		}
	}

	// An endpoint gone and a timeout passed: those entries are not restored.
	gone := newHarness(t, thisNode, 7)
	gone.lb.RestoreAffinity(got)
	gone.set(sp, ready(eps[1], thisNode), ready(eps[2], "other"))
	kept := gone.lb.Affinity()
	for _, e := range kept {
		if e.Endpoint.String() == eps[0] {
			t.Errorf("entry of the departed endpoint restored: %+v", e)
		}
	}
	if len(kept) == 0 || len(kept) == 30 {
		t.Errorf("%d entries kept of 30, want those of the remaining endpoints", len(kept))
	}
	for i := range got {
		got[i].Idle += time.Minute
	}
	expired := newHarness(t, thisNode, 7)
	expired.lb.RestoreAffinity(got)
	expired.set(sp, ready(eps[0], thisNode), ready(eps[1], thisNode), ready(eps[2], "other"))
	if n := len(expired.lb.Affinity()); n != 0 {
		t.Errorf("%d expired entries restored", n)
	}
}
