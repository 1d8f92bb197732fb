package userspace

import (
	"net"
	"slices"
	"strings"
	"sync"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/portalloc"
)

// problems collects what a Proxier reports to Options.OnProblem.
type problems struct {
	mu   sync.Mutex
	list []proxy.Problem
}

func (p *problems) add(pr proxy.Problem) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.list = append(p.list, pr)
}

func (p *problems) of(svc, reason string) []proxy.Problem {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []proxy.Problem
	for _, pr := range p.list {
		if pr.Service.Name == svc && pr.Reason == reason {
			out = append(out, pr)
		}
	}
	return out
}

// TestProblemsReportedOnce: a service port without a free proxy port, and a Service with an
// invalid annotation, are reported once each, however many syncs and updates follow; once the
// port is served and then left without one again, it is reported again.
func TestProblemsReportedOnce(t *testing.T) {
	holder, err := net.Listen("tcp", "[::]:0")
	if err != nil {
		t.Fatal(err)
	}
	port := holder.Addr().(*net.TCPAddr).Port
	holder.Close() // a port that was free a moment ago: the range is this one port
	var got problems
	p := newTestProxier(t, Options{PortRange: portalloc.Range{Base: port, Size: 1}, OnProblem: got.add})
	tr := p.Tracker()
	first := service("first", []v1.ServicePort{tcpPort("tcp", 80)})
	tr.OnServiceUpdate(nil, first)
	p.Sync()
	second := service("second", []v1.ServicePort{tcpPort("tcp", 80)})
	tr.OnServiceUpdate(nil, second)
	bad := service("bad", []v1.ServicePort{tcpPort("tcp", 80)}, func(s *v1.Service) {
		s.UID = "uid-bad"
		s.Annotations = map[string]string{proxy.ProxyProtocolAnnotation: "v3"}
	})
	tr.OnServiceUpdate(nil, bad)
	for range 3 {
		p.Sync()
	}
	// An update that leaves the invalid value as it is.
	bad2 := bad.DeepCopy()
	bad2.Labels = map[string]string{"touched": "yes"}
	tr.OnServiceUpdate(bad, bad2)
	p.Sync()

	ex := got.of("second", proxy.ReasonProxyPortExhausted)
	if len(ex) != 1 {
		t.Fatalf("ProxyPortExhausted problems of second: %+v, want 1 (all: %+v)", ex, got.list)
	}
	if want := (types.NamespacedName{Namespace: "default", Name: "second"}); ex[0].Service != want ||
		!strings.Contains(ex[0].Message, `port "tcp" (TCP 80)`) || !strings.Contains(ex[0].Message, "--proxy-port-range") {
		t.Errorf("problem %+v", ex[0])
	}
	inv := got.of("bad", proxy.ReasonInvalidField)
	if len(inv) != 1 || inv[0].UID != "uid-bad" || !strings.Contains(inv[0].Message, "metadata.annotations["+proxy.ProxyProtocolAnnotation+"]") ||
		!strings.Contains(inv[0].Message, `"v3"`) {
		t.Fatalf("InvalidField problems of bad: %+v, want 1 naming the annotation and value", inv)
	}
	if n := len(got.of("first", proxy.ReasonProxyPortExhausted)); n != 0 {
		t.Errorf("first, which has the port, reported %d times", n)
	}

	// The first service goes, and so does bad (served without the header, it waits for a port
	// too, and would take the freed one about as often as second): the second gets the port; a
	// third service is the one without a port now, reported once.
	tr.OnServiceUpdate(first, nil)
	tr.OnServiceUpdate(bad2, nil)
	p.Sync()
	if proxyPort(t, p, proxy.Name{Namespace: "default", Name: "second", Port: "tcp"}) != port {
		t.Fatal("second not served after the port freed up")
	}
	tr.OnServiceUpdate(nil, service("third", []v1.ServicePort{tcpPort("tcp", 80)}))
	p.Sync()
	p.Sync()
	if n := len(got.of("third", proxy.ReasonProxyPortExhausted)); n != 1 {
		t.Errorf("third reported %d times, want 1", n)
	}
	if n := len(got.of("second", proxy.ReasonProxyPortExhausted)); n != 1 {
		t.Errorf("second reported %d times in all, want 1", n)
	}
	// A Service deleted and created again with the same invalid value is reported again.
	tr.OnServiceUpdate(nil, bad)
	if n := len(got.of("bad", proxy.ReasonInvalidField)); n != 2 {
		t.Errorf("bad recreated: reported %d times in all, want 2", n)
	}
	if i := slices.IndexFunc(got.list, func(pr proxy.Problem) bool { return pr.Reason == "" || pr.Message == "" }); i >= 0 {
		t.Errorf("problem without reason or message: %+v", got.list[i])
	}
}
