package kubeapi

import (
	"context"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
	s := New(client, Options{NodeName: "node1"})
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
