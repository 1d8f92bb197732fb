//go:build linux

package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source/kubeapi"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// recorder is a source.Handler that records every call as a line: "svc add NAME", "svc update
// NAME", "svc delete NAME", "slice add NAME", ..., "synced".
type recorder struct {
	mu     sync.Mutex
	events []string
}

func kind(prevNil, curNil bool) string {
	switch {
	case prevNil:
		return "add"
	case curNil:
		return "delete"
	}
	return "update"
}

func (r *recorder) add(s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, s)
}

func (r *recorder) OnServiceUpdate(prev, cur *corev1.Service) {
	obj := cur
	if obj == nil {
		obj = prev
	}
	if prev != nil && cur != nil && prev.ResourceVersion == cur.ResourceVersion {
		return // a resync
	}
	r.add(fmt.Sprintf("svc %s %s", kind(prev == nil, cur == nil), obj.Name))
}

func (r *recorder) OnEndpointSliceUpdate(prev, cur *discoveryv1.EndpointSlice) {
	obj := cur
	if obj == nil {
		obj = prev
	}
	if prev != nil && cur != nil && prev.ResourceVersion == cur.ResourceVersion {
		return
	}
	r.add(fmt.Sprintf("slice %s %s", kind(prev == nil, cur == nil), obj.Name))
}

func (r *recorder) OnSynced() { r.add("synced") }

func (r *recorder) snapshot() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.events...)
}

func (r *recorder) count(ev string) int {
	n := 0
	for _, e := range r.snapshot() {
		if e == ev {
			n++
		}
	}
	return n
}

// waitEvent waits until ev has been recorded.
func (r *recorder) waitEvent(t *testing.T, ev string) {
	t.Helper()
	harness.WaitFor(t, converge, func() error {
		if r.count(ev) == 0 {
			return fmt.Errorf("no %q in %q", ev, r.snapshot())
		}
		return nil
	})
}

// TestKubeAPISource runs the kubeapi source against a real API server.
func TestKubeAPISource(t *testing.T) {
	n := netns.NewNetwork(t, "e2k")
	c := cluster.Start(t, cluster.Options{Network: n})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	svcs := c.Client.CoreV1().Services(harness.Namespace)
	slices := c.Client.DiscoveryV1().EndpointSlices(harness.Namespace)

	// State before the source starts: delivered before OnSynced.
	pre := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("pre", harness.TCPPort("tcp", 80, 8080)))
	harness.ApplySlice(ctx, t, c.Client, harness.Slice(pre))

	// The proxy's own API client (kubeapi.NewClient), as the binary builds it.
	apiClient, err := kubeapi.NewClient(c.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	var logBuf syncBuffer
	rec := &recorder{}
	src := kubeapi.New(apiClient, kubeapi.Options{Log: zerolog.New(&logBuf), WaitLogInterval: time.Second})
	srcCtx, stopSrc := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- src.Run(srcCtx, rec) }()
	t.Cleanup(func() {
		stopSrc()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		if t.Failed() {
			t.Logf("source log:\n%s", logBuf.String())
		}
	})

	t.Run("initial state then synced", func(t *testing.T) {
		rec.waitEvent(t, "synced")
		evs := rec.snapshot()
		idx := map[string]int{}
		for i, e := range evs {
			if _, ok := idx[e]; !ok {
				idx[e] = i
			}
		}
		for _, want := range []string{"svc add pre", "slice add pre-e2e", "svc add kubernetes"} {
			i, ok := idx[want]
			if !ok || i > idx["synced"] {
				t.Errorf("%q not delivered before OnSynced: %q", want, evs)
			}
		}
	})

	t.Run("create update delete", func(t *testing.T) {
		svc := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("life", harness.TCPPort("tcp", 80, 8080)))
		rec.waitEvent(t, "svc add life")
		svc.Labels = map[string]string{"changed": "yes"}
		if _, err := svcs.Update(ctx, svc, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		rec.waitEvent(t, "svc update life")
		slice := harness.ApplySlice(ctx, t, c.Client, harness.Slice(svc))
		rec.waitEvent(t, "slice add life-e2e")
		slice.Labels["changed"] = "yes"
		if _, err := slices.Update(ctx, slice, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		rec.waitEvent(t, "slice update life-e2e")
		if err := slices.Delete(ctx, slice.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		rec.waitEvent(t, "slice delete life-e2e")
		if err := svcs.Delete(ctx, svc.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		rec.waitEvent(t, "svc delete life")
	})

	t.Run("other proxy's and headless services are not delivered", func(t *testing.T) {
		other := harness.ClusterIPService("other", harness.TCPPort("tcp", 80, 8080))
		other.Labels = map[string]string{"service.kubernetes.io/service-proxy-name": "someone-else"}
		harness.CreateService(ctx, t, c.Client, other)
		hl := harness.ClusterIPService("headless", harness.TCPPort("tcp", 80, 8080))
		hl.Spec.ClusterIP = corev1.ClusterIPNone
		harness.CreateService(ctx, t, c.Client, hl)
		// Events of one informer arrive in order: once a later service is seen, the earlier
		// ones would have been.
		harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("after-other", harness.TCPPort("tcp", 80, 8080)))
		rec.waitEvent(t, "svc add after-other")
		for _, name := range []string{"other", "headless"} {
			for _, e := range rec.snapshot() {
				if strings.HasSuffix(e, " "+name) && strings.HasPrefix(e, "svc ") {
					t.Errorf("service %s delivered: %q", name, e)
				}
			}
		}
	})

	t.Run("API server restarted", func(t *testing.T) {
		// test/cluster has no restart: run the same command line again.
		cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", c.APIServer.Pid()))
		if err != nil {
			t.Fatalf("read the API server's command line: %v", err)
		}
		args := strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")
		c.APIServer.Stop()
		down := time.Now()
		// A second source (a proxy starting on a node) while the API server is down: it waits,
		// says so, and syncs once the server is back.
		var lateLog syncBuffer
		late := &recorder{}
		lateSrc := kubeapi.New(apiClient, kubeapi.Options{Log: zerolog.New(&lateLog), WaitLogInterval: time.Second})
		lateCtx, stopLate := context.WithCancel(ctx)
		lateDone := make(chan error, 1)
		go func() { lateDone <- lateSrc.Run(lateCtx, late) }()
		t.Cleanup(func() {
			stopLate()
			if err := <-lateDone; err != nil {
				t.Errorf("late source Run: %v", err)
			}
			if t.Failed() {
				t.Logf("late source log:\n%s", lateLog.String())
			}
		})
		time.Sleep(3 * time.Second) // the watches fail and retry meanwhile
		if late.count("synced") != 0 {
			t.Fatal("a source started while the API server is down reported the initial sync")
		}
		for _, want := range []string{"waiting for initial sync", "failed, client-go retries with back-off"} {
			if !strings.Contains(lateLog.String(), want) {
				t.Errorf("the late source's log does not say %q while the API server is down:\n%s", want, lateLog.String())
			}
		}
		apiserver := c.ControlPlane.Start(t, args...)
		harness.WaitFor(t, 90*time.Second, func() error {
			select {
			case <-apiserver.Done():
				return fmt.Errorf("kube-apiserver exited: %v", apiserver.Err())
			default:
			}
			rctx, rcancel := context.WithTimeout(ctx, 3*time.Second)
			defer rcancel()
			_, err := c.Client.CoreV1().Namespaces().Get(rctx, harness.Namespace, metav1.GetOptions{})
			return err
		})
		t.Logf("API server back after %v", time.Since(down).Round(time.Millisecond))
		// The restarted server refuses to allocate ClusterIPs until its ServiceCIDR informer
		// has synced ("range is full"): retry the create.
		harness.WaitFor(t, converge, func() error {
			_, err := svcs.Create(ctx, harness.ClusterIPService("after-restart", harness.TCPPort("tcp", 80, 8080)), metav1.CreateOptions{})
			return err
		})
		rec.waitEvent(t, "svc add after-restart")
		t.Logf("source delivered a change %v after the API server went down", time.Since(down).Round(time.Millisecond))
		late.waitEvent(t, "synced")
		for _, want := range []string{"svc add pre", "slice add pre-e2e"} {
			if late.count(want) != 1 {
				t.Errorf("late source: %q delivered %d times, want once: %q", want, late.count(want), late.snapshot())
			}
		}
		if got := rec.count("synced"); got != 1 {
			t.Errorf("OnSynced called %d times, want once", got)
		}
		if got := rec.count("svc add pre"); got != 1 {
			t.Errorf("service pre added %d times after the restart, want once (a relist must not re-add)", got)
		}
	})
}

// syncBuffer is a bytes.Buffer safe for concurrent writes and reads.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
