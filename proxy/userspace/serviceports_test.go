package userspace

import (
	"math/rand/v2"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// TestServicePortsLocked: the listeners of a service are found as a run of the sorted list,
// exactly its own, among services whose names extend one another ("a", "a-b", "ab") or sort
// between its ports, as ports come and go in random order.
func TestServicePortsLocked(t *testing.T) {
	p := New(Options{Portals: discardPortals{}, NodeAddrs: noNodeAddrs})
	r := rand.New(rand.NewPCG(5, 6))
	svcs := []types.NamespacedName{{Namespace: "ns", Name: "a"}, {Namespace: "ns", Name: "a-b"}, {Namespace: "ns", Name: "ab"},
		{Namespace: "ns-a", Name: "a"}, {Namespace: "n", Name: "s"}}
	ports := []string{"", "a", "http", "z"}
	model := map[proxy.Name]bool{}
	for step := range 400 {
		s := svcs[r.IntN(len(svcs))]
		n := proxy.Name{Namespace: s.Namespace, Name: s.Name, Port: ports[r.IntN(len(ports))]}
		if r.IntN(3) > 0 {
			var added []*listener
			p.upsertPortLocked(&proxy.ServicePort{Name: n, Protocol: v1.ProtocolTCP, Port: 80}, &added)
			p.insertSortedLocked(added)
			model[n] = true
		} else {
			p.removePortLocked(n)
			delete(model, n)
		}
		for _, svc := range svcs {
			var got, want []string
			for _, l := range p.servicePortsLocked(svc) {
				got = append(got, l.key)
			}
			for n := range model {
				if n.Service() == svc {
					want = append(want, n.String())
				}
			}
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Fatalf("step %d: ports of %s: %q, want %q", step, svc, got, want)
			}
		}
	}
}
