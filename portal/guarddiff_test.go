package portal

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// guardPorts returns the ports each form of guard in rules lists, as "form: sorted ports".
func guardPorts(t *testing.T, rules []string) map[string][]int {
	t.Helper()
	out := map[string][]int{}
	for _, r := range rules {
		f, ports, ok := parseGuard(r)
		if !ok {
			t.Fatalf("not a guard: %s", r)
		}
		k := f.before + "…" + f.after
		out[k] = append(out[k], ports...)
	}
	for k := range out {
		slices.Sort(out[k])
		out[k] = slices.Compact(out[k])
	}
	return out
}

// applyDelta applies an iptables-restore input of "-D"/"-A" lines to rules as the kernel would.
func applyDelta(t *testing.T, rules []string, delta []byte) []string {
	t.Helper()
	out := slices.Clone(rules)
	for _, l := range strings.Split(strings.TrimSpace(string(delta)), "\n") {
		switch {
		case l == "":
		case strings.HasPrefix(l, "-D "):
			i := slices.Index(out, "-A "+l[len("-D "):])
			if i < 0 {
				t.Fatalf("deletes a rule that is not there: %s", l)
			}
			out = slices.Delete(out, i, i+1)
		case strings.HasPrefix(l, "-A "):
			out = append(out, l)
		default:
			t.Fatalf("unexpected line %q", l)
		}
	}
	return out
}

// TestGuardDelta changes the proxy ports at random and checks that the guards' partial update
// guards exactly the new ports, returns the rules it leaves, and deletes a rule only when one of
// its ports is gone.
func TestGuardDelta(t *testing.T) {
	cfg := v4Config()
	guards := func(ports map[string][]int) []string {
		var ps []Portal
		for proto, list := range ports {
			for i, p := range list {
				ps = append(ps, Portal{Comment: fmt.Sprintf("ns/%s%d:p", proto, i), Protocol: proto, Port: 80, ProxyPort: p, ClusterIP: a("10.96.0.1")})
			}
		}
		_, filter := Render(cfg, Host{}, ps)
		_, g := splitGuards(ruleLines(filter))
		return g
	}
	r := rand.New(rand.NewPCG(1, 2))
	cur := map[string][]int{"tcp": nil, "udp": nil}
	written := guards(cur)
	for step := range 300 {
		next := map[string][]int{}
		removed := false
		for proto, list := range cur {
			keep := slices.DeleteFunc(slices.Clone(list), func(int) bool {
				if r.IntN(8) == 0 {
					removed = true
					return true
				}
				return false
			})
			for range r.IntN(3) {
				p := 30000 + r.IntN(90) // few blocks: new ports land in blocks that have some
				if !slices.Contains(keep, p) {
					keep = append(keep, p)
				}
			}
			next[proto] = keep
		}
		want := guards(next)
		delta, after, ok := guardDelta(written, want)
		if !ok {
			t.Fatalf("step %d: guards did not parse", step)
		}
		applied := applyDelta(t, written, delta)
		if !slices.Equal(applied, after) {
			t.Fatalf("step %d: returned rules\n%s\nare not what the input leaves\n%s", step, strings.Join(after, "\n"), strings.Join(applied, "\n"))
		}
		if got, w := guardPorts(t, after), guardPorts(t, want); !maps.EqualFunc(got, w, slices.Equal) {
			t.Fatalf("step %d: guards %v, want %v", step, got, w)
		}
		if !removed && strings.Contains(string(delta), "-D ") {
			t.Fatalf("step %d: no port removed, yet the input deletes:\n%s", step, delta)
		}
		cur, written = next, after
	}
}
