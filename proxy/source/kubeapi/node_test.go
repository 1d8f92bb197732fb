package kubeapi

import (
	"context"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source"
)

func TestNodeEligibleRules(t *testing.T) {
	now := metav1.Now()
	tests := []struct {
		name string
		node v1.Node
		want bool
	}{
		{"plain node", v1.Node{}, true},
		{"other taint", v1.Node{Spec: v1.NodeSpec{Taints: []v1.Taint{{Key: "dedicated", Effect: v1.TaintEffectNoSchedule}}}}, true},
		{"autoscaler taint", v1.Node{Spec: v1.NodeSpec{Taints: []v1.Taint{{Key: TaintToBeDeleted, Effect: v1.TaintEffectNoSchedule}}}}, false},
		{"being deleted", v1.Node{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &now}}, false},
	}
	for _, tt := range tests {
		if got := NodeEligible(&tt.node); got != tt.want {
			t.Errorf("%s: NodeEligible = %v, want %v", tt.name, got, tt.want)
		}
	}
}

// The source follows its own Node: tainted for deletion, untainted, deleted.
func TestSourceWatchesItsNode(t *testing.T) {
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node1"}}
	client, watches := fakeClient(node)
	s := New(clientsetClient{client}, Options{NodeName: "node1"})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, &countSynced{n: new(int)}) }()
	t.Cleanup(func() { cancel(); <-done })
	waitWatches(t, watches, "services", "endpointslices", "nodes")

	wait := func(what string, want bool) {
		t.Helper()
		deadline := time.Now().Add(hangGuard)
		for s.NodeEligible() != want {
			if time.Now().After(deadline) {
				t.Fatalf("%s: NodeEligible stayed %v", what, !want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	wait("untainted node", true)
	nodes := client.CoreV1().Nodes()
	node.Spec.Taints = []v1.Taint{{Key: TaintToBeDeleted, Effect: v1.TaintEffectNoSchedule}}
	if _, err := nodes.Update(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	wait("tainted ToBeDeletedByClusterAutoscaler", false)
	node.Spec.Taints = nil
	if _, err := nodes.Update(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	wait("taint removed", true)
	if err := nodes.Delete(ctx, "node1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	wait("node deleted", false)
}

// zoneRecorder is a Handler that routes by topology: it records the zones it is told.
type zoneRecorder struct {
	countSynced
	zones chan string
}

var _ source.TopologyHandler = (*zoneRecorder)(nil)

func (z *zoneRecorder) OnNodeTopology(zone string) { z.zones <- zone }

// The source hands its Node's topology.kubernetes.io/zone label to a TopologyHandler: when first
// seen, on each change of the label (not on other changes), and "" when the label goes or the
// Node is deleted.
func TestSourceReportsNodeZone(t *testing.T) {
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node1", Labels: map[string]string{v1.LabelTopologyZone: "zone-a"}}}
	other := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node2", Labels: map[string]string{v1.LabelTopologyZone: "zone-x"}}}
	client, watches := fakeClient(node, other)
	h := &zoneRecorder{countSynced: countSynced{n: new(int)}, zones: make(chan string, 10)}
	startSource(t, client, Options{NodeName: "node1"}, h)
	waitWatches(t, watches, "services", "endpointslices", "nodes")

	expect := func(what, want string) {
		t.Helper()
		select {
		case got := <-h.zones:
			if got != want {
				t.Errorf("%s: zone %q, want %q", what, got, want)
			}
		case <-time.After(hangGuard):
			t.Fatalf("%s: no zone delivered", what)
		}
	}
	ctx := context.Background()
	nodes := client.CoreV1().Nodes()
	update := func(edit func(*v1.Node)) {
		t.Helper()
		edit(node)
		if _, err := nodes.Update(ctx, node, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	expect("initial", "zone-a")
	update(func(n *v1.Node) { n.Labels[v1.LabelTopologyZone] = "zone-b" })
	expect("label changed", "zone-b")
	// Not a zone change: nothing is delivered, so the next delivery is the next change.
	update(func(n *v1.Node) {
		n.Spec.Taints = []v1.Taint{{Key: TaintToBeDeleted, Effect: v1.TaintEffectNoSchedule}}
	})
	update(func(n *v1.Node) { n.Labels["other"] = "x" })
	update(func(n *v1.Node) { delete(n.Labels, v1.LabelTopologyZone) })
	expect("label removed", "")
	update(func(n *v1.Node) { n.Labels[v1.LabelTopologyZone] = "zone-c" })
	expect("label back", "zone-c")
	if err := nodes.Delete(ctx, "node1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	expect("node deleted", "")
	select {
	case z := <-h.zones:
		t.Errorf("unexpected zone %q (another node's?)", z)
	default:
	}
}
