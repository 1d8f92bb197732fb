//go:build linux

package e2e

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
)

// measureBigSync creates n ClusterIP services with one endpoint each (through a few goroutines),
// waits until the last one answers, and logs the time that took and the longest sync the proxy
// logged meanwhile.
func measureBigSync(ctx context.Context, t *testing.T, f *fixture, n int) {
	t.Helper()
	logBefore := len(f.proxy.Log())
	start := time.Now()
	const workers = 4
	svcs := make([]*corev1.Service, n)
	errs := make(chan error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := w; i < n; i += workers {
				s := harness.ClusterIPService(fmt.Sprintf("bulk-%04d", i), harness.TCPPort("tcp", 80, echoPort))
				created, err := f.c.Client.CoreV1().Services(s.Namespace).Create(ctx, s, metav1.CreateOptions{})
				if err != nil {
					errs <- fmt.Errorf("create %s: %w", s.Name, err)
					return
				}
				slice := harness.Slice(created, f.endpoints(i%len(f.backends))...)
				if _, err := f.c.Client.DiscoveryV1().EndpointSlices(s.Namespace).Create(ctx, slice, metav1.CreateOptions{}); err != nil {
					errs <- fmt.Errorf("create slice %s: %w", slice.Name, err)
					return
				}
				svcs[i] = created
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	created := time.Since(start)
	// Every service must answer; the last created ones are the last the proxy learns of.
	for i := n - 1; i >= 0; i -= max(1, n/20) {
		waitAnswer(t, f.node.NS, "tcp", harness.Addr(svcs[i], 0))
	}
	all := time.Since(start)
	// And a full sync of them all, measured without API latency: the longest sync logged.
	longest, ports := longestSync(f.proxy.Log()[logBefore:])
	t.Logf("MEASURE %d services with one endpoint each: created in %v; all answering %v after the first create; longest sync logged meanwhile: %v (ports=%d)",
		n, created.Round(time.Millisecond), all.Round(time.Millisecond), longest, ports)
	// A forced full resync: flush our chain; the next periodic sync rewrites every rule.
	logAfter := len(f.proxy.Log())
	f.node.Run(t, "iptables", "-w", "-t", "nat", "-F", "KUBE-PORTALS-CONTAINER")
	flushed := time.Now()
	waitAnswer(t, f.clientPod.NS, "tcp", harness.Addr(svcs[0], 0))
	waitAnswer(t, f.clientPod.NS, "tcp", harness.Addr(svcs[n-1], 0))
	full, fullPorts := longestSync(f.proxy.Log()[logAfter:])
	t.Logf("MEASURE %d services: rules restored %v after a flush (sync period %v); longest sync since: %v (ports=%d)",
		n, time.Since(flushed).Round(time.Millisecond), syncPeriod, full, fullPorts)
}

// The proxier's debug line after a sync holds "synced", "ports=N" and "took=D" (zerolog's console
// writer sorts fields by name and writes durations as milliseconds without a unit).
var (
	tookField  = regexp.MustCompile(`\btook=([0-9.]+)([a-zµ]*)`)
	portsField = regexp.MustCompile(`\bports=(\d+)`)
)

// longestSync returns the longest "took" of the sync lines in log and the ports of that sync.
func longestSync(log string) (time.Duration, int) {
	var longest time.Duration
	var ports int
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, " synced ") {
			continue
		}
		m := tookField.FindStringSubmatch(line)
		pm := portsField.FindStringSubmatch(line)
		if m == nil || pm == nil {
			continue
		}
		unit := m[2]
		if unit == "" {
			unit = "ms"
		}
		d, err := time.ParseDuration(m[1] + unit)
		if err != nil {
			continue
		}
		if d > longest {
			longest = d
			ports, _ = strconv.Atoi(pm[1])
		}
	}
	return longest, ports
}
