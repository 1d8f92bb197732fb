package manifests

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/equality"
)

// randomManifest returns a file of random services (from a small pool of names, so that files
// claim the same ones now and then) and EndpointSlices: ClusterIP services with and without an
// explicit address (from a small pool, so that they collide now and then), NodePort services
// with and without an explicit node port, LoadBalancers with a health check node port; and now
// and then a document that does not decode.
func randomManifest(r *rand.Rand) string {
	var b strings.Builder
	for range r.IntN(6) {
		name := fmt.Sprintf("s%d", r.IntN(14))
		fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Service\nmetadata: {name: %s}\nspec:\n", name)
		switch r.IntN(5) {
		case 0:
			fmt.Fprintf(&b, "  clusterIP: 10.96.0.%d\n", 2+r.IntN(6))
		case 1:
			b.WriteString("  type: NodePort\n")
		case 2:
			b.WriteString("  type: LoadBalancer\n  externalTrafficPolicy: Local\n")
		}
		fmt.Fprintf(&b, "  ports:\n  - {name: p, port: %d", 80+r.IntN(2))
		if r.IntN(4) == 0 {
			fmt.Fprintf(&b, ", nodePort: %d", 30000+r.IntN(4))
		}
		b.WriteString("}\n")
		if r.IntN(3) > 0 {
			fmt.Fprintf(&b, "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: %s-1\n  labels: {kubernetes.io/service-name: %s}\n"+
				"addressType: IPv4\nports: [{name: p, port: 8080}]\nendpoints: [{addresses: [10.0.0.%d]}]\n", name, name, 1+r.IntN(3))
		}
	}
	if r.IntN(12) == 0 {
		b.WriteString("---\napiVersion: v1\nkind: Service\nmetadata: {name: broken\nspec: [\n")
	}
	return b.String()
}

// TestIncrementalMergeMatchesFull changes files of a directory at random, step by step, and
// checks after each step that a source merging incrementally where it can has delivered the
// same objects as one that always merges in full.
func TestIncrementalMergeMatchesFull(t *testing.T) {
	for seed := range uint64(6) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 7))
			dir := t.TempDir()
			write := func(name, content string) {
				tmp := filepath.Join(dir, ".tmp")
				if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
					t.Fatal(err)
				}
				if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
					t.Fatal(err)
				}
			}
			files := []string{"a.yaml", "b.yaml", "c.yaml"}
			for _, f := range files {
				write(f, randomManifest(r))
			}
			type side struct {
				s     *Source
				clock *fakeClock
				rec   *rec
			}
			newSide := func(full bool) side {
				// A small range, so that hashed addresses collide with each other and with
				// the explicit ones.
				s, clock, r := scannedSource(t, dir, Options{ServiceCIDRs: []netip.Prefix{netip.MustParsePrefix("10.96.0.0/28")}},
					func(s *Source) { s.fullMergesOnly = full })
				return side{s, clock, r}
			}
			inc, full := newSide(false), newSide(true)
			for step := range 150 {
				f := files[r.IntN(len(files))]
				what := "rewrote " + f
				switch r.IntN(10) {
				case 0:
					if err := os.Remove(filepath.Join(dir, f)); err != nil && !os.IsNotExist(err) {
						t.Fatal(err)
					}
					what = "removed " + f
				default:
					write(f, randomManifest(r))
				}
				for _, sd := range []side{inc, full} {
					settledScan(t, sd.s, sd.clock, sd.rec, false)
					sd.clock.advance(sd.s.opts.debounce()) // a removed file's objects go after Debounce
					if _, err := sd.s.scan(sd.rec, false); err != nil {
						t.Fatal(err)
					}
				}
				if diff := diffObjects(inc.rec.objects, full.rec.objects); diff != "" {
					t.Fatalf("step %d (%s): incremental and full merges differ:\n%s", step, what, diff)
				}
				// What carries over to the next allocation, no more (no leak) and no less.
				ia, fa := inc.s.allocated, full.s.allocated
				if !maps.EqualFunc(ia.ips, fa.ips, maps.Equal) || !maps.Equal(ia.ports, fa.ports) || len(ia.done) != len(fa.done) {
					t.Fatalf("step %d (%s): allocations differ: incremental %v %v (%d copies), full %v %v (%d copies)",
						step, what, ia.ips, ia.ports, len(ia.done), fa.ips, fa.ports, len(fa.done))
				}
			}
			if inc.s.incrementalMerges == 0 || full.s.incrementalMerges != 0 {
				t.Fatalf("incremental merges: %d on the incremental side (want some), %d on the full side (want none)",
					inc.s.incrementalMerges, full.s.incrementalMerges)
			}
			t.Logf("%d incremental merges", inc.s.incrementalMerges)
		})
	}
}

// diffObjects describes how two handlers' views of the objects differ; "" when they agree.
func diffObjects(a, b map[string]any) string {
	var out []string
	for _, k := range slices.Sorted(func(yield func(string) bool) {
		seen := map[string]bool{}
		for _, m := range []map[string]any{a, b} {
			for k := range m {
				if !seen[k] {
					seen[k] = true
					if !yield(k) {
						return
					}
				}
			}
		}
	}) {
		if !equality.Semantic.DeepEqual(a[k], b[k]) {
			out = append(out, fmt.Sprintf("%s:\n  incremental: %+v\n  full:        %+v", k, a[k], b[k]))
		}
	}
	return strings.Join(out, "\n")
}
