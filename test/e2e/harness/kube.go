//go:build linux

package harness

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// Namespace is the Kubernetes namespace the helpers create objects in.
const Namespace = metav1.NamespaceDefault

// ManagedBy is the endpointslice.kubernetes.io/managed-by label of the slices Slice builds.
const ManagedBy = "kup-e2e"

// TCPPort returns a TCP service port name: port → targetPort.
func TCPPort(name string, port, targetPort int32) corev1.ServicePort {
	return corev1.ServicePort{Name: name, Protocol: corev1.ProtocolTCP, Port: port, TargetPort: intstr.FromInt32(targetPort)}
}

// UDPPort returns a UDP service port name: port → targetPort.
func UDPPort(name string, port, targetPort int32) corev1.ServicePort {
	return corev1.ServicePort{Name: name, Protocol: corev1.ProtocolUDP, Port: port, TargetPort: intstr.FromInt32(targetPort)}
}

// ClusterIPService returns a ClusterIP Service in Namespace with the given ports (no selector:
// the tests write the EndpointSlices themselves).
func ClusterIPService(name string, ports ...corev1.ServicePort) *corev1.Service {
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: Namespace},
		Spec:       corev1.ServiceSpec{Type: corev1.ServiceTypeClusterIP, Ports: ports},
	}
}

// NodePortService is ClusterIPService of type NodePort (the API server allocates the node ports
// unless the ports set them).
func NodePortService(name string, ports ...corev1.ServicePort) *corev1.Service {
	s := ClusterIPService(name, ports...)
	s.Spec.Type = corev1.ServiceTypeNodePort
	return s
}

// CreateService creates svc and returns the created object (with ClusterIP and node ports
// allocated). It fails the test on error.
func CreateService(ctx context.Context, t testing.TB, client kubernetes.Interface, svc *corev1.Service) *corev1.Service {
	t.Helper()
	created, err := client.CoreV1().Services(svc.Namespace).Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("harness: create service %s/%s: %v", svc.Namespace, svc.Name, err)
	}
	return created
}

// DeleteService deletes the Service namespace/name and the EndpointSlices labelled with it. It
// fails the test on error (not-found is fine).
func DeleteService(ctx context.Context, t testing.TB, client kubernetes.Interface, namespace, name string) {
	t.Helper()
	if err := client.CoreV1().Services(namespace).Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatalf("harness: delete service %s/%s: %v", namespace, name, err)
	}
	err := client.DiscoveryV1().EndpointSlices(namespace).DeleteCollection(ctx, metav1.DeleteOptions{},
		metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + name})
	if err != nil {
		t.Fatalf("harness: delete endpointslices of %s/%s: %v", namespace, name, err)
	}
}

// Addr returns the service's ClusterIP and the port of svc.Spec.Ports[i] as "IP:port".
func Addr(svc *corev1.Service, i int) string {
	return netip.AddrPortFrom(netip.MustParseAddr(svc.Spec.ClusterIP), uint16(svc.Spec.Ports[i].Port)).String()
}

// NodePortAddr returns ip and the node port of svc.Spec.Ports[i] as "IP:port".
func NodePortAddr(ip netip.Addr, svc *corev1.Service, i int) string {
	return netip.AddrPortFrom(ip, uint16(svc.Spec.Ports[i].NodePort)).String()
}

// Endpoint is one backend in an EndpointSlice built by Slice.
type Endpoint struct {
	// IP is the pod's address.
	IP netip.Addr
	// Node is the endpoint's nodeName; empty leaves it unset.
	Node string
	// Name names the endpoint (its targetRef pod name), for messages; optional.
	Name string
	// NotReady clears ready (and serving); Terminating sets terminating and clears ready.
	NotReady, Terminating bool
}

// Slice returns the EndpointSlice "<service>-e2e" for svc (ports from its target ports, which
// must be numbers) holding eps. Like the EndpointSlice controller's, it carries the
// endpoints.kubernetes.io/last-change-trigger-time annotation: now, the time of the change.
func Slice(svc *corev1.Service, eps ...Endpoint) *discoveryv1.EndpointSlice {
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name:        svc.Name + "-e2e",
			Namespace:   svc.Namespace,
			Annotations: map[string]string{corev1.EndpointsLastChangeTriggerTime: time.Now().UTC().Format(time.RFC3339Nano)},
			Labels: map[string]string{
				discoveryv1.LabelServiceName: svc.Name,
				discoveryv1.LabelManagedBy:   ManagedBy,
			},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for _, sp := range svc.Spec.Ports {
		name, proto, port := sp.Name, sp.Protocol, sp.TargetPort.IntVal
		if port == 0 {
			port = sp.Port
		}
		slice.Ports = append(slice.Ports, discoveryv1.EndpointPort{Name: &name, Protocol: &proto, Port: &port})
	}
	for _, e := range eps {
		ready, serving, terminating := !e.NotReady && !e.Terminating, !e.NotReady, e.Terminating
		ep := discoveryv1.Endpoint{
			Addresses:  []string{e.IP.String()},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready, Serving: &serving, Terminating: &terminating},
		}
		if e.Node != "" {
			node := e.Node
			ep.NodeName = &node
		}
		if e.Name != "" {
			ep.TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: svc.Namespace, Name: e.Name}
		}
		slice.Endpoints = append(slice.Endpoints, ep)
	}
	return slice
}

// ApplySlice creates slice, or replaces the endpoints, ports and annotations of the existing one
// of the same name. It fails the test on error.
func ApplySlice(ctx context.Context, t testing.TB, client kubernetes.Interface, slice *discoveryv1.EndpointSlice) *discoveryv1.EndpointSlice {
	t.Helper()
	got, err := applySlice(ctx, client, slice)
	if err != nil {
		t.Fatalf("harness: %v", err)
	}
	return got
}

func applySlice(ctx context.Context, client kubernetes.Interface, slice *discoveryv1.EndpointSlice) (*discoveryv1.EndpointSlice, error) {
	api := client.DiscoveryV1().EndpointSlices(slice.Namespace)
	created, err := api.Create(ctx, slice, metav1.CreateOptions{})
	if err == nil {
		return created, nil
	}
	if !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("create endpointslice %s/%s: %w", slice.Namespace, slice.Name, err)
	}
	cur, err := api.Get(ctx, slice.Name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("get endpointslice %s/%s: %w", slice.Namespace, slice.Name, err)
	}
	cur.Endpoints, cur.Ports, cur.Annotations = slice.Endpoints, slice.Ports, slice.Annotations
	updated, err := api.Update(ctx, cur, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("update endpointslice %s/%s: %w", slice.Namespace, slice.Name, err)
	}
	return updated, nil
}

// IPTablesSave returns `iptables-save` (all tables) inside ns. It fails the test on error
// (including a missing iptables-save).
func IPTablesSave(t testing.TB, ns *netns.NS) string {
	t.Helper()
	return save(t, ns, "iptables-save")
}

// IP6TablesSave is IPTablesSave for IPv6: `ip6tables-save` inside ns.
func IP6TablesSave(t testing.TB, ns *netns.NS) string {
	t.Helper()
	return save(t, ns, "ip6tables-save")
}

// save runs tool (iptables-save or ip6tables-save) inside ns and returns its output.
func save(t testing.TB, ns *netns.NS, tool string) string {
	t.Helper()
	if _, err := exec.LookPath(tool); err != nil {
		t.Fatalf("harness: %s not installed: %v", tool, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := ns.Exec(ctx, tool)
	if err != nil {
		t.Fatalf("harness: %v", err)
	}
	return out
}

// RulesFor returns the lines of an iptables-save listing that mention the service
// namespace/name in a comment ("namespace/name:port" or "namespace/name" followed by a space or
// quote).
func RulesFor(listing, namespace, name string) []string {
	key := namespace + "/" + name
	var out []string
	for _, line := range strings.Split(listing, "\n") {
		i := strings.Index(line, key)
		if i < 0 {
			continue
		}
		rest := line[i+len(key):]
		if rest == "" || strings.ContainsAny(rest[:1], ": \"") {
			out = append(out, line)
		}
	}
	return out
}

// Sockets returns `ss -Htlnu` inside ns: the listening TCP sockets and bound UDP sockets. It fails
// the test on error.
func Sockets(t testing.TB, ns *netns.NS) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := ns.Exec(ctx, "ss", "-Hltnu")
	if err != nil {
		t.Fatalf("harness: %v", err)
	}
	return out
}

// PortHeld reports whether some socket in ns holds port for network ("tcp" or "udp"): binding
// the port on every address fails with EADDRINUSE. The proxy holds TCP NodePorts with sockets
// that are bound but do not listen, which `ss -l` does not show.
func PortHeld(t testing.TB, ns *netns.NS, network string, port int) bool {
	t.Helper()
	addr := fmt.Sprintf(":%d", port)
	var c io.Closer
	var err error
	if network == "udp" {
		c, err = ns.ListenPacket("udp", addr)
	} else {
		c, err = ns.Listen("tcp", addr)
	}
	if err == nil {
		c.Close()
		return false
	}
	if errors.Is(err, syscall.EADDRINUSE) {
		return true
	}
	t.Fatalf("harness: probing %s port %d in %s: %v", network, port, ns, err)
	return false
}
