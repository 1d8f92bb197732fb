//go:build scalemeasure

// The measurements of issue 16, outside `make test` (they take minutes and assert no timing):
// `make scale-measure`, or go test -tags scalemeasure -run TestScaleMeasure -v ./test/e2e/.

package e2e

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// TestScaleMeasure measures, for each service count in KUP_SCALE_MEASURE (default
// 5000,10000,20000), from a manifests
// directory and iptables portals in a node namespace: process start → every sampled service
// answering, the first full sync (metric), RSS and open descriptors once serving, idle CPU over
// KUP_SCALE_CPU_WINDOW (default 30s, the default sync period), and one more service → its first
// answer (and → the source's log line that it loaded the file, polled every 10 ms); and process start → the manifests source's initial delivery (its log line), the
// source's share of the start. It logs one MEASURE line per count; it asserts nothing about
// timing.
func TestScaleMeasure(t *testing.T) {
	spec := os.Getenv("KUP_SCALE_MEASURE")
	if spec == "" {
		spec = "5000,10000,20000"
	}
	window := 30 * time.Second
	if w := os.Getenv("KUP_SCALE_CPU_WINDOW"); w != "" {
		d, err := time.ParseDuration(w)
		if err != nil {
			t.Fatal(err)
		}
		window = d
	}
	var lines []string
	for _, s := range strings.Split(spec, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			t.Fatal(err)
		}
		t.Run(strconv.Itoa(n), func(t *testing.T) {
			lines = append(lines, measureScale(t, n, window))
		})
	}
	for _, l := range lines {
		t.Log(l)
	}
}

func measureScale(t *testing.T, n int, window time.Duration) string {
	e := newScaleEnv(t, fmt.Sprintf("sm%d", n/1000), n)
	started := time.Now()
	p := e.start(t)
	pid := p.Pid()
	delivered := watchLog(p, "initial scan delivered", 40*time.Second)
	last, missing := waitAll(e.node.NS, sampleIndexes(n, 200), 40*time.Second)
	all := sinceOrNever(started, last)
	source := sinceOrNever(started, <-delivered)
	full, err := firstFullSync(e.node.NS, time.Minute)
	if err != nil {
		t.Log(err)
	}
	time.Sleep(2 * time.Second)
	rss, _ := procStatusKiB(pid, "VmRSS")
	fds, _ := openFDs(pid)
	a, _ := cpuTicks(pid)
	time.Sleep(window)
	b, _ := cpuTicks(pid)
	cpu := (b - a) / window.Seconds() // ticks/s = percent of a core
	// One more service.
	writeScaleManifests(t, e.dir, n, n+1, e.pod.IP)
	added := time.Now()
	loaded := watchLog(p, fmt.Sprintf("svc-%06d.yaml", n), 30*time.Second) // the source's "manifest file loaded"
	lastOne, miss1 := waitAll(e.node.NS, []int{n}, 30*time.Second)
	oneMore := sinceOrNever(added, lastOne)
	oneLoaded := sinceOrNever(added, <-loaded)
	m, _ := scrapeMetrics(e.node.NS, scaleMetricsAddr)
	line := fmt.Sprintf("MEASURE n=%d start→source-delivered=%v start→all-answering=%v (sample 200, %d never) first-full-sync=%v RSS=%.1fMiB fds=%d idle-CPU=%.2f%% (%v) one-more→answer=%v (missed %d, source loaded it after %v) unservable=%v",
		n, source.Round(10*time.Millisecond), all.Round(time.Millisecond), missing, full.Round(time.Millisecond), float64(rss)/1024, fds, cpu, window,
		oneMore.Round(time.Millisecond), miss1, oneLoaded.Round(time.Millisecond), m["kube_userspace_proxy_service_ports_unservable"])
	t.Log(line)
	if tail := p.Tail(5); strings.Contains(tail, "panic") {
		t.Errorf("proxy log:\n%s", tail)
	}
	return line
}

// watchLog looks at p's log every 10 ms until it holds what (or timeout) and sends when it was
// first seen (zero if never) on the returned channel. The goroutine ends then.
func watchLog(p *netns.Process, what string, timeout time.Duration) <-chan time.Time {
	seen := make(chan time.Time, 1)
	go func() {
		deadline := time.Now().Add(timeout)
		for time.Now().Before(deadline) {
			if strings.Contains(p.Log(), what) {
				seen <- time.Now()
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		seen <- time.Time{}
	}()
	return seen
}
