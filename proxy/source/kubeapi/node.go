package kubeapi

import (
	"context"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source"
)

// TaintToBeDeleted is the taint the cluster autoscaler puts on a node it is about to remove.
const TaintToBeDeleted = "ToBeDeletedByClusterAutoscaler"

// NodeEligible reports whether a node should receive load-balancer traffic, as kube-proxy's
// /healthz judges it: not while it is being deleted or carries the autoscaler's
// ToBeDeletedByClusterAutoscaler taint, so that load balancers drain it first.
func NodeEligible(n *v1.Node) bool {
	if n.DeletionTimestamp != nil {
		return false
	}
	for _, t := range n.Spec.Taints {
		if t.Key == TaintToBeDeleted {
			return false
		}
	}
	return true
}

// NodeEligible reports the eligibility of Options.NodeName's Node (see the function
// NodeEligible): true until the Node has been seen, false once it is deleted.
func (s *Source) NodeEligible() bool { return !s.nodeIneligible.Load() }

// watchNode runs an informer on this node's Node object until ctx ends, keeping NodeEligible
// up to date and, when h implements source.TopologyHandler, telling it the Node's zone label
// (through d, which serialises Handler calls).
func (s *Source) watchNode(ctx context.Context, d *dispatcher, h source.Handler) {
	nodes := s.client.Nodes()
	selector := fields.OneTermEqualSelector("metadata.name", s.opts.NodeName).String()
	inf := newInformer(s.client, &v1.Node{}, s.nodeW, 0,
		func(o *metav1.ListOptions) { o.FieldSelector = selector },
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return nodes.List(ctx, o) },
		nodes.Watch)
	nh := &nodeHandler{s: s, log: s.log, d: d}
	nh.topology, _ = h.(source.TopologyHandler)
	if _, err := setup(inf, s.nodeW, nh, 0); err != nil {
		s.log.Error().Err(err).Msg("cannot watch this node: /healthz reports it eligible and its zone stays unknown (topology hints ignored)")
		return
	}
	inf.RunWithContext(ctx)
}

// nodeHandler turns Node events into Source.nodeIneligible and zone updates for topology.
// Its calls come from the informer's one delivery goroutine.
type nodeHandler struct {
	s   *Source
	log zerolog.Logger
	d   *dispatcher
	// topology receives the zone; nil when the Handler does not route by topology.
	topology source.TopologyHandler
	// zone is the zone last delivered to topology (the TopologyHandler starts with "").
	zone string
}

func (h *nodeHandler) set(n *v1.Node, deleted bool) {
	if n.Name != h.s.opts.NodeName {
		return // another node, from a server or fake that ignores the field selector
	}
	eligible := !deleted && NodeEligible(n)
	if was := !h.s.nodeIneligible.Swap(!eligible); was != eligible {
		h.log.Info().Str("node", n.Name).Bool("eligible", eligible).Bool("deleted", deleted).
			Msg("node eligibility for load-balancer traffic changed")
	}
	// A deleted Node has no zone any more: hints are ignored, as kube-proxy forgets the node's
	// labels when its Node is deleted.
	zone := ""
	if !deleted {
		zone = n.Labels[v1.LabelTopologyZone]
	}
	if h.topology == nil || zone == h.zone {
		return
	}
	h.log.Info().Str("node", n.Name).Str("zone", zone).Str("previousZone", h.zone).
		Msg("node zone (" + v1.LabelTopologyZone + ") changed")
	h.zone = zone
	h.d.run(func() { h.topology.OnNodeTopology(zone) })
}

func (h *nodeHandler) OnAdd(obj any, _ bool) {
	if n, ok := obj.(*v1.Node); ok {
		h.set(n, false)
	}
}

func (h *nodeHandler) OnUpdate(_, obj any) {
	if n, ok := obj.(*v1.Node); ok {
		h.set(n, false)
	}
}

func (h *nodeHandler) OnDelete(obj any) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	if n, ok := obj.(*v1.Node); ok {
		h.set(n, true)
	}
}
