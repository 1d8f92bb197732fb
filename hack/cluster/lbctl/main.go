// Command lbctl gives the LoadBalancer Services of the local cluster (hack/cluster.sh) their
// addresses, as a cloud's controller does: every Service of type LoadBalancer without a
// loadBalancerClass gets one address of the pool (default 10.77.1.0/24, which the cluster's
// client routes to node-1) in status.loadBalancer.ingress. spec.loadBalancerIP, when set, is
// the address it gets (or none, with an error in the log, when that address is outside the
// pool or another Service's). An address stays with its Service until the Service is deleted
// or stops being a LoadBalancer (its status is then cleared); a restarted lbctl keeps the
// addresses the Services' status shows. No address is ever given to two Services.
//
//	lbctl --kubeconfig FILE [--pool 10.77.1.0/24]
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"slices"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/workqueue"
)

func main() {
	kubeconfig := flag.String("kubeconfig", "", "the kubeconfig to reach the API server with (required)")
	pool := flag.String("pool", "10.77.1.0/24", "the IPv4 prefix whose addresses are handed out (but its network and broadcast addresses)")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := run(*kubeconfig, *pool, log); err != nil {
		log.Error("exiting", "err", err)
		os.Exit(1)
	}
}

func run(kubeconfig, pool string, log *slog.Logger) error {
	if kubeconfig == "" {
		return errors.New("--kubeconfig is required")
	}
	prefix, err := netip.ParsePrefix(pool)
	if err != nil {
		return fmt.Errorf("--pool: %w", err)
	}
	alloc, err := newAllocator(prefix)
	if err != nil {
		return fmt.Errorf("--pool: %w", err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig %s: %w", kubeconfig, err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	c := newController(client, alloc, log)
	log.Info("starting", "pool", prefix.String())
	return c.run(ctx)
}

// controller keeps the LoadBalancer Services' status.loadBalancer.ingress to their addresses.
type controller struct {
	client   kubernetes.Interface
	alloc    *allocator
	log      *slog.Logger
	factory  informers.SharedInformerFactory
	services corelisters.ServiceLister
	synced   cache.InformerSynced
	queue    workqueue.TypedRateLimitingInterface[string]
	// waiting are the Services that want an address and have none (their request is taken or the
	// pool is full): they are tried again whenever an address is released.
	waiting map[string]bool
}

func newController(client kubernetes.Interface, alloc *allocator, log *slog.Logger) *controller {
	factory := informers.NewSharedInformerFactory(client, 0)
	inf := factory.Core().V1().Services()
	c := &controller{client: client, alloc: alloc, log: log, factory: factory,
		services: inf.Lister(), synced: inf.Informer().HasSynced,
		queue:   workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]()),
		waiting: map[string]bool{}}
	enqueue := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			c.queue.Add(key)
		}
	}
	_, _ = inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, obj any) { enqueue(obj) },
		DeleteFunc: enqueue,
	})
	return c
}

// run serves until ctx is done: it waits for the Services, takes over the addresses their
// status shows, then handles the Services one at a time.
func (c *controller) run(ctx context.Context) error {
	defer c.queue.ShutDown()
	c.factory.Start(ctx.Done())
	defer c.factory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), c.synced) {
		return ctx.Err()
	}
	if err := c.adopt(); err != nil {
		return err
	}
	go func() {
		<-ctx.Done()
		c.queue.ShutDown()
	}()
	for c.next(ctx) {
	}
	return nil
}

// adopt gives the Services whose status already shows an address of the pool that address
// (the oldest Service first when two show the same), before any Service is handled, so that a
// restart changes no address.
func (c *controller) adopt() error {
	svcs, err := c.services.List(labels.Everything())
	if err != nil {
		return fmt.Errorf("list Services: %w", err)
	}
	slices.SortFunc(svcs, func(a, b *v1.Service) int {
		return cmp.Or(a.CreationTimestamp.Compare(b.CreationTimestamp.Time), cmp.Compare(key(a), key(b)))
	})
	for _, svc := range svcs {
		if !wantsAddress(svc) {
			continue
		}
		current := c.shown(svc)
		if len(current) == 0 {
			continue
		}
		requested, _ := netip.ParseAddr(svc.Spec.LoadBalancerIP)
		if ip, err := c.alloc.Assign(key(svc), requested, current); err == nil {
			c.log.Info("kept the address the status shows", "service", key(svc), "ip", ip.String())
		}
	}
	return nil
}

// next handles one Service from the queue; false once the queue is shut down.
func (c *controller) next(ctx context.Context) bool {
	k, quit := c.queue.Get()
	if quit {
		return false
	}
	defer c.queue.Done(k)
	if err := c.sync(ctx, k); err != nil {
		c.log.Warn("will retry", "service", k, "err", err)
		c.queue.AddRateLimited(k)
		return true
	}
	c.queue.Forget(k)
	return true
}

// sync makes the Service k's status show its address, or none.
func (c *controller) sync(ctx context.Context, k string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(k)
	if err != nil {
		return nil // not a key of ours: nothing to retry
	}
	svc, err := c.services.Services(ns).Get(name)
	if apierrors.IsNotFound(err) {
		delete(c.waiting, k)
		c.release(k)
		return nil
	}
	if err != nil {
		return err
	}
	if !wantsAddress(svc) {
		delete(c.waiting, k)
		c.release(k)
		if len(c.shown(svc)) > 0 {
			return c.setStatus(ctx, svc, netip.Addr{})
		}
		return nil
	}
	var requested netip.Addr
	if s := svc.Spec.LoadBalancerIP; s != "" {
		if requested, err = netip.ParseAddr(s); err != nil {
			c.log.Error("no address: spec.loadBalancerIP is not an IP address", "service", k, "loadBalancerIP", s)
			delete(c.waiting, k)
			c.release(k)
			return c.clearShown(ctx, svc)
		}
	}
	ip, err := c.alloc.Assign(k, requested, c.shown(svc))
	if err != nil {
		if !c.waiting[k] {
			c.log.Error("no address", "service", k, "err", err)
		}
		c.waiting[k] = true
		c.release(k)
		return c.clearShown(ctx, svc)
	}
	delete(c.waiting, k)
	if ing := svc.Status.LoadBalancer.Ingress; len(ing) == 1 && ing[0].IP == ip.String() && ing[0].Hostname == "" {
		return nil
	}
	if err := c.setStatus(ctx, svc, ip); err != nil {
		return err
	}
	c.log.Info("assigned", "service", k, "ip", ip.String())
	return nil
}

// release frees k's address; the Services waiting for one are then tried again.
func (c *controller) release(k string) {
	ip, had := c.alloc.Lookup(k)
	if !had {
		return
	}
	c.alloc.Release(k)
	c.log.Info("released", "service", k, "ip", ip.String())
	for w := range c.waiting {
		if w != k {
			c.queue.Add(w)
		}
	}
}

// clearShown removes the pool's addresses from svc's status, which must not show an address
// that is not (or no longer) its own.
func (c *controller) clearShown(ctx context.Context, svc *v1.Service) error {
	if len(c.shown(svc)) == 0 {
		return nil
	}
	return c.setStatus(ctx, svc, netip.Addr{})
}

// setStatus writes ip (none when invalid) as svc's load-balancer ingress.
func (c *controller) setStatus(ctx context.Context, svc *v1.Service, ip netip.Addr) error {
	svc = svc.DeepCopy()
	svc.Status.LoadBalancer = v1.LoadBalancerStatus{}
	if ip.IsValid() {
		svc.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: ip.String()}}
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if _, err := c.client.CoreV1().Services(svc.Namespace).UpdateStatus(ctx, svc, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update the status of Service %s: %w", key(svc), err)
	}
	return nil
}

// shown returns the addresses of the pool that svc's status shows.
func (c *controller) shown(svc *v1.Service) []netip.Addr {
	var out []netip.Addr
	for _, ing := range svc.Status.LoadBalancer.Ingress {
		if ip, err := netip.ParseAddr(ing.IP); err == nil && c.alloc.usable(ip.Unmap()) {
			out = append(out, ip.Unmap())
		}
	}
	return out
}

// wantsAddress reports whether svc is a LoadBalancer that this controller serves: no
// loadBalancerClass (another controller's), IPv4 among its families.
func wantsAddress(svc *v1.Service) bool {
	if svc.Spec.Type != v1.ServiceTypeLoadBalancer || svc.Spec.LoadBalancerClass != nil {
		return false
	}
	return len(svc.Spec.IPFamilies) == 0 || slices.Contains(svc.Spec.IPFamilies, v1.IPv4Protocol)
}

func key(svc *v1.Service) string { return svc.Namespace + "/" + svc.Name }
