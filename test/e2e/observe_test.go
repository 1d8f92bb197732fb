//go:build linux

package e2e

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/events"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// observeMetricsAddr is where the proxy of TestObservedAsKubeProxy serves metrics, in its node.
const observeMetricsAddr = "127.0.0.1:10249"

// TestObservedAsKubeProxy checks, on a real API server, what operators see of the proxy as they
// see kube-proxy: the Node start Event (compared with upstream kube-proxy's own, recorded on
// another node), client-go's request metrics with the API server's real codes, and the Warning
// Events on Services it cannot serve as asked, as `kubectl describe service` finds them, one
// per problem however often the Service is synced and updated.
func TestObservedAsKubeProxy(t *testing.T) {
	nw := netns.NewNetwork(t, "obs")
	c := cluster.Start(t, cluster.Options{Network: nw})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	node, ref := nw.AddNode(t, "obsnode"), nw.AddNode(t, "obsref")
	for _, n := range []struct {
		name string
		node *netns.Node
	}{{"obsnode", node}, {"obsref", ref}} {
		if _, err := c.CreateNode(ctx, n.name, n.node.IP); err != nil {
			t.Fatal(err)
		}
	}

	// Upstream kube-proxy's start event, the reference.
	kp := c.KubeProxy(t, ref.NS, "obsref")
	want := waitEvent(ctx, t, c.Client, "default", func(e *eventsv1.Event) bool {
		return e.Regarding.Kind == "Node" && e.Regarding.Name == "obsref" && e.Reason == events.ReasonStarting
	})
	kp.Stop()

	// One proxy port only: the default/kubernetes Service takes it at the first sync, and every
	// Service created later has none.
	holder, err := node.NS.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	port := holder.Addr().String()[strings.LastIndexByte(holder.Addr().String(), ':')+1:]
	holder.Close()
	harness.StartProxy(t, node.NS, harness.ProxyConfig{NodeName: "obsnode", Kubeconfig: c.Kubeconfig,
		MetricsBindAddress: observeMetricsAddr, Args: []string{"--proxy-port-range=" + port + "-" + port}})

	t.Run("Node start event as kube-proxy's", func(t *testing.T) {
		got := waitEvent(ctx, t, c.Client, "default", func(e *eventsv1.Event) bool {
			return e.Regarding.Kind == "Node" && e.Regarding.Name == "obsnode" && e.Reason == events.ReasonStarting
		})
		wantRef := want.Regarding
		wantRef.Name = "obsnode"
		if got.Regarding != wantRef || got.Type != want.Type || got.Action != want.Action || got.Note != want.Note ||
			(got.Series == nil) != (want.Series == nil) {
			t.Errorf("start event\n  ours        %s\n  kube-proxy's %s", describe(got), describe(want))
		}
		if got.ReportingController != events.Controller || !strings.HasPrefix(got.ReportingInstance, events.Controller+"-") {
			t.Errorf("reported by %s/%s, want %s/%s-<host> (kube-proxy's: %s/%s)", got.ReportingController, got.ReportingInstance,
				events.Controller, events.Controller, want.ReportingController, want.ReportingInstance)
		}
		t.Logf("ours: %s; kube-proxy's: %s", describe(got), describe(want))
	})

	bad := corev1.Service{}
	t.Run("Warning Event naming an invalid annotation, once", func(t *testing.T) {
		s := harness.ClusterIPService("badpp", harness.TCPPort("tcp", 80, echoPort))
		s.Annotations = map[string]string{proxy.ProxyProtocolAnnotation: "v3"}
		bad = *harness.CreateService(ctx, t, c.Client, s)
		ev := waitServiceEvent(ctx, t, c.Client, &bad, proxy.ReasonInvalidField)
		if ev.Type != corev1.EventTypeWarning || !strings.Contains(ev.Message, "metadata.annotations["+proxy.ProxyProtocolAnnotation+"]") ||
			!strings.Contains(ev.Message, `"v3"`) {
			t.Errorf("event %s %s: %q, want a Warning naming the annotation and its value", ev.Type, ev.Reason, ev.Message)
		}
		// Updates that leave the value as it is, and the syncs they cause, add none.
		for i := range 3 {
			cur, err := c.Client.CoreV1().Services(bad.Namespace).Get(ctx, bad.Name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			cur.Labels = map[string]string{"touched": fmt.Sprint(i)}
			if _, err := c.Client.CoreV1().Services(bad.Namespace).Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		// A later Service's event is written after anything those updates could have caused
		// (one writer, in order).
		marker := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("marker", harness.TCPPort("tcp", 80, echoPort)))
		waitServiceEvent(ctx, t, c.Client, marker, proxy.ReasonProxyPortExhausted)
		if evs := serviceEvents(ctx, t, c.Client, &bad, proxy.ReasonInvalidField); len(evs) != 1 {
			t.Errorf("after 3 updates and their syncs: %d InvalidField events, want 1", len(evs))
		}
	})

	t.Run("Warning Event for a port without a free proxy port", func(t *testing.T) {
		svc := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("noport", harness.TCPPort("tcp", 80, echoPort)))
		ev := waitServiceEvent(ctx, t, c.Client, svc, proxy.ReasonProxyPortExhausted)
		if ev.Type != corev1.EventTypeWarning || !strings.Contains(ev.Message, `port "tcp" (TCP 80)`) ||
			!strings.Contains(ev.Message, "--proxy-port-range "+port+"-"+port) {
			t.Errorf("event %s %s: %q, want a Warning naming the port and the range", ev.Type, ev.Reason, ev.Message)
		}
		if ev.Source.Component != "" || ev.ReportingController != events.Controller {
			t.Errorf("reported by %q (source %q)", ev.ReportingController, ev.Source.Component)
		}
	})

	t.Run("client-go request metrics", func(t *testing.T) {
		u, err := url.Parse(c.URL)
		if err != nil {
			t.Fatal(err)
		}
		host := u.Host
		m, err := harness.ScrapeMetrics(node.NS, observeMetricsAddr)
		if err != nil {
			t.Fatal(err)
		}
		for _, sample := range []string{
			// The informers' lists and watches, the Service lookups for events.
			fmt.Sprintf(`rest_client_requests_total{code="200",host=%q,method="GET"}`, host),
			// The Events created.
			fmt.Sprintf(`rest_client_requests_total{code="201",host=%q,method="POST"}`, host),
			fmt.Sprintf(`rest_client_request_duration_seconds_count{host=%q,verb="GET"}`, host),
			fmt.Sprintf(`rest_client_request_duration_seconds_count{host=%q,verb="POST"}`, host),
			fmt.Sprintf(`rest_client_request_duration_seconds_bucket{host=%q,verb="GET",le="60"}`, host),
			fmt.Sprintf(`rest_client_response_size_bytes_count{host=%q,verb="GET"}`, host),
		} {
			if m[sample] < 1 {
				t.Errorf("%s = %v, want at least 1", sample, m[sample])
			}
		}
		if t.Failed() {
			for k, v := range m {
				if strings.HasPrefix(k, "rest_client_") {
					t.Logf("%s %v", k, v)
				}
			}
		}
	})
}

// describe formats an Event's fields for a message.
func describe(e *eventsv1.Event) string {
	return fmt.Sprintf("regarding=%s/%s %s/%s uid=%q type=%s reason=%s action=%s note=%q namespace=%s series=%v",
		e.Regarding.APIVersion, e.Regarding.Kind, e.Regarding.Namespace, e.Regarding.Name, e.Regarding.UID,
		e.Type, e.Reason, e.Action, e.Note, e.Namespace, e.Series)
}

// waitEvent waits for an events.k8s.io/v1 Event in namespace that match accepts, and returns it.
func waitEvent(ctx context.Context, t *testing.T, client kubernetes.Interface, namespace string, match func(*eventsv1.Event) bool) *eventsv1.Event {
	t.Helper()
	var found *eventsv1.Event
	harness.WaitFor(t, converge, func() error {
		list, err := client.EventsV1().Events(namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for i := range list.Items {
			if match(&list.Items[i]) {
				found = &list.Items[i]
				return nil
			}
		}
		return fmt.Errorf("no such event among %d in %s", len(list.Items), namespace)
	})
	return found
}

// serviceEvents lists the core/v1 Events of svc with reason as `kubectl describe service` finds
// them (field selector on the involved object's name, namespace, kind and UID).
func serviceEvents(ctx context.Context, t *testing.T, client kubernetes.Interface, svc *corev1.Service, reason string) []corev1.Event {
	t.Helper()
	sel := fields.Set{
		"involvedObject.name": svc.Name, "involvedObject.namespace": svc.Namespace,
		"involvedObject.kind": "Service", "involvedObject.uid": string(svc.UID), "reason": reason,
	}.AsSelector().String()
	list, err := client.CoreV1().Events(svc.Namespace).List(ctx, metav1.ListOptions{FieldSelector: sel})
	if err != nil {
		t.Fatal(err)
	}
	return list.Items
}

// waitServiceEvent waits until svc has an Event with reason (see serviceEvents) and returns it.
func waitServiceEvent(ctx context.Context, t *testing.T, client kubernetes.Interface, svc *corev1.Service, reason string) corev1.Event {
	t.Helper()
	var ev corev1.Event
	harness.WaitFor(t, converge, func() error {
		evs := serviceEvents(ctx, t, client, svc, reason)
		if len(evs) == 0 {
			return fmt.Errorf("no %s event on service %s/%s", reason, svc.Namespace, svc.Name)
		}
		ev = evs[0]
		return nil
	})
	return ev
}
