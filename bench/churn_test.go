//go:build bench

package bench

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// churnSettings are the sizes of the endpoint churn workload.
type churnSettings struct {
	services, endpoints int           // the bulk: services × endpoints (fake addresses)
	rate                float64       // slice updates per second during the churn
	duration            time.Duration // of the churn
	probeEvery          time.Duration // a rolling-update step of the probe service (real pods)
	scales              int           // large services scaled 10 → 1,000 → 10 during the churn
}

// churnConfig returns the sizes of a full or quick run; KUP_BENCH_CHURN_SERVICES=N and
// KUP_BENCH_CHURN_DURATION=D (a Go duration) override the bulk's size and the churn's length
// (a development aid, not for results).
func churnConfig(quick bool) (churnSettings, error) {
	cfg := churnSettings{services: 10000, endpoints: 10, rate: 20, duration: 5 * time.Minute, probeEvery: 3 * time.Second, scales: 3}
	if quick {
		cfg = churnSettings{services: 1000, endpoints: 10, rate: 20, duration: 30 * time.Second, probeEvery: 2 * time.Second, scales: 1}
	}
	if v := os.Getenv("KUP_BENCH_CHURN_SERVICES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			return cfg, fmt.Errorf("KUP_BENCH_CHURN_SERVICES=%q: want a count", v)
		}
		cfg.services = n
	}
	if v := os.Getenv("KUP_BENCH_CHURN_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return cfg, fmt.Errorf("KUP_BENCH_CHURN_DURATION=%q: want a duration", v)
		}
		cfg.duration = d
	}
	return cfg, nil
}

// Network programming samples of each proxy's metric.
const (
	npCount = `kubeproxy_network_programming_duration_seconds_count{ip_family="IPv4"}`
	npSum   = `kubeproxy_network_programming_duration_seconds_sum{ip_family="IPv4"}`
	npLE025 = `kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="0.25"}`
	// The histograms histQuantile reads: kube-proxy's (buckets from 0.25 s), and
	// kube-userspace-proxy's fine one of the same observations (buckets from 1 ms).
	npHist     = "kubeproxy_network_programming_duration_seconds"
	npFineHist = "kube_userspace_proxy_network_programming_duration_seconds"
)

// churnPod is the fake address of endpoint k of bulk service i (10.200.0.0/14, never routed:
// no connection goes to them).
func churnPod(i, k int) string {
	n := i*16 + k%16
	return netip.AddrFrom4([4]byte{10, byte(200 + n>>16), byte(n >> 8), byte(n)}).String()
}

// bulkSlice is the slice of bulk service svc with endpoints first..first+n-1 (mod 16), all
// ready but notReady and terminating (indexes among them; -1 for none).
func bulkSlice(svc *corev1.Service, i, first, n, notReady, terminating int) *discoveryv1.EndpointSlice {
	var eps []harness.Endpoint
	for k := range n {
		eps = append(eps, harness.Endpoint{IP: netip.MustParseAddr(churnPod(i, first+k)), NotReady: k == notReady, Terminating: k == terminating})
	}
	return harness.Slice(svc, eps...)
}

// runChurn is the endpoint churn workload: its own control plane, one node per path (upstream
// kube-proxy in iptables mode and in nftables mode, kube-userspace-proxy), the bulk of services
// with fake endpoints, then churn at a steady rate, while a probe service of real pods is
// rolled now and then and a client on each node connects to it without pause.
func runChurn(t *testing.T, quick bool, outDir string) {
	cfg, err := churnConfig(quick)
	if err != nil {
		t.Fatal(err)
	}
	rep := &ChurnReport{Started: time.Now(), Quick: quick, LoadStart: loadavg(), Machine: machine(t)}
	defer func() {
		rep.Finished, rep.LoadEnd = time.Now(), loadavg()
		if t.Failed() {
			rep.Notes = append(rep.Notes, "INCOMPLETE: the run failed before the end.")
		}
		writeChurnReport(t, rep, outDir)
	}()
	ctx := context.Background()
	nw := netns.NewNetwork(t, "churn")
	c := cluster.Start(t, cluster.Options{Network: nw})
	srvNode := nw.AddNode(t, "csrv")
	if _, err := c.CreateNode(ctx, "csrv", srvNode.IP); err != nil {
		t.Fatal(err)
	}
	const probePods = 6
	var probe []harness.Endpoint
	for i := range probePods {
		name := fmt.Sprintf("cp%d", i)
		pod := nw.AddPod(t, srvNode, name)
		harness.StartEcho(t, pod.NS, name, echoPort)
		probe = append(probe, harness.Endpoint{IP: pod.IP, Node: "csrv", Name: name})
	}
	// The large services' endpoints: two pods, each answering on a range of addresses (a local
	// route in the pod: its echo server's socket on 0.0.0.0 takes them all), routed to it by its
	// node: "bigold" the 10 endpoints a large service starts and ends with, "bignew" the 990 it
	// is scaled up with.
	bigOld, bigNew := nw.AddPod(t, srvNode, "bigold"), nw.AddPod(t, srvNode, "bignew")
	harness.StartEcho(t, bigOld.NS, "bigold", echoPort)
	harness.StartEcho(t, bigNew.NS, "bignew", echoPort)
	for _, r := range []struct {
		pod   *netns.Pod
		scope string
	}{{bigOld, bigOldRange}, {bigNew, bigNewRange}} {
		r.pod.Run(t, "ip", "route", "add", "local", r.scope, "dev", "lo")
		srvNode.Run(t, "ip", "route", "add", r.scope, "dev", "v"+fmt.Sprint(r.pod.IP.As4()[3]))
	}
	probeSvc := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("probe", harness.TCPPort("tcp", 80, echoPort)))
	active := []int{0, 1, 2}
	probeSlice := func(ready []int, notReady, terminating int) *discoveryv1.EndpointSlice {
		var eps []harness.Endpoint
		for _, i := range ready {
			eps = append(eps, probe[i])
		}
		if notReady >= 0 {
			e := probe[notReady]
			e.NotReady = true
			eps = append(eps, e)
		}
		if terminating >= 0 {
			e := probe[terminating]
			e.Terminating = true
			eps = append(eps, e)
		}
		return harness.Slice(probeSvc, eps...)
	}
	harness.ApplySlice(ctx, t, c.Client, probeSlice(active, -1, -1))

	nodes := map[string]*netns.Node{}
	pids := map[string]int{}
	names := map[string]string{PathIPTables: "cipt", PathNFTables: "cnft", PathKUP: "ckup"}
	for _, p := range ChurnPaths {
		nodes[p] = nw.AddNode(t, names[p])
		if _, err := c.CreateNode(ctx, names[p], nodes[p].IP); err != nil {
			t.Fatal(err)
		}
		nodes[p].Run(t, "ip", "route", "add", bigRange, "via", srvNode.IP.String())
	}
	var bigSvcs []*corev1.Service
	for k := range cfg.scales {
		svc := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService(fmt.Sprintf("big-%d", k), harness.TCPPort("tcp", 80, echoPort)))
		harness.ApplySlice(ctx, t, c.Client, bigSlice(svc, 0, 10, 0, 0))
		bigSvcs = append(bigSvcs, svc)
	}
	// start starts (or restarts) every proxy and waits until each serves the probe service.
	stops := map[string]func(){}
	startKUP := func() {
		kup := harness.StartProxy(t, nodes[PathKUP].NS, harness.ProxyConfig{NodeName: names[PathKUP], Kubeconfig: c.Kubeconfig,
			MetricsBindAddress: metricsAddr, LogLevel: "info", Args: []string{"--profiling"}, ReadyTimeout: 10 * time.Minute,
			Ready: func(ctx context.Context) error {
				_, err := harness.Ask(ctx, nodes[PathKUP].NS, "tcp", harness.Addr(probeSvc, 0))
				return err
			}})
		pids[PathKUP], stops[PathKUP] = kup.Pid(), kup.Stop
	}
	for _, p := range []string{PathIPTables, PathNFTables} {
		var extra []string
		if p == PathNFTables {
			extra = []string{"--proxy-mode=nftables"}
		}
		kp := c.KubeProxyWithin(t, nodes[p].NS, names[p], 15*time.Minute, extra...)
		pids[p], stops[p] = kp.Pid(), kp.Stop
	}
	startKUP()
	for _, p := range ChurnPaths {
		harness.WaitFor(t, 10*time.Minute, func() error {
			_, err := harness.AskTimeout(ctx, nodes[p].NS, "tcp", harness.Addr(probeSvc, 0), time.Second)
			return err
		})
	}

	// The bulk: services × endpoints, slices of at most 100 endpoints (one per service here).
	start := time.Now()
	bulk := make([]*corev1.Service, cfg.services)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < cfg.services; i += 8 {
				s := harness.ClusterIPService(fmt.Sprintf("churn-%05d", i), harness.TCPPort("tcp", 80, echoPort))
				cs, err := c.Client.CoreV1().Services(s.Namespace).Create(ctx, s, metav1.CreateOptions{})
				if err == nil {
					_, err = c.Client.DiscoveryV1().EndpointSlices(s.Namespace).Create(ctx, bulkSlice(cs, i, 0, cfg.endpoints, -1, -1), metav1.CreateOptions{})
				}
				if err != nil {
					errs <- err
					return
				}
				bulk[i] = cs
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		t.Fatalf("create the bulk: %v", err)
	}
	t.Logf("%d services × %d endpoints created in %v", cfg.services, cfg.endpoints, time.Since(start).Round(time.Millisecond))
	scrape := func(p string) map[string]float64 {
		m, err := harness.ScrapeMetrics(nodes[p].NS, metricsAddr)
		if err != nil {
			t.Errorf("%s: %v", p, err)
		}
		return m
	}
	// Every proxy has programmed every slice (one observation each: all were written after
	// the proxies started).
	for _, p := range ChurnPaths {
		harness.WaitFor(t, 20*time.Minute, func() error {
			if got := scrape(p)[npCount]; got < float64(cfg.services) {
				return fmt.Errorf("%s: %v of %d slices programmed", p, got, cfg.services)
			}
			return nil
		})
	}
	t.Logf("all proxies programmed the bulk %v after its creation began", time.Since(start).Round(time.Millisecond))
	time.Sleep(3 * time.Second)
	grown := rep.Metric(fmt.Sprintf("RSS at %s × %d endpoints, grown from none", thousands(cfg.services), cfg.endpoints), "MiB", false)
	for _, p := range ChurnPaths {
		kib, err := rssKiB(pids[p])
		record(t, grown, p, float64(kib)/1024, err)
	}
	// kube-userspace-proxy restarted with the bulk present, as a node's proxy usually starts: the
	// figure of the targets. (The churn then runs on the restarted proxy.) The kube-proxies keep
	// running: restarted at 100,000 endpoints, kube-proxy in iptables mode did not finish its
	// first sync's iptables-restore within 15 minutes on the two-core machine (a whole core the
	// whole time), so their row is the grown process's, and the report says so.
	stops[PathKUP]()
	restarted := time.Now()
	startKUP()
	t.Logf("kube-userspace-proxy restarted and serving in %v", time.Since(restarted).Round(time.Millisecond))
	time.Sleep(10 * time.Second)
	rss := rep.Metric(fmt.Sprintf("RSS at %s × %d endpoints", thousands(cfg.services), cfg.endpoints), "MiB", false)
	rules := rep.Metric(fmt.Sprintf("rules at %s × %d endpoints", thousands(cfg.services), cfg.endpoints), "lines", false)
	for _, p := range ChurnPaths {
		kib, err := rssKiB(pids[p])
		record(t, rss, p, float64(kib)/1024, err)
		tool := []string{"iptables-save"}
		if p == PathNFTables {
			tool = []string{"nft", "list", "ruleset"}
		}
		out, err := nodes[p].NS.Exec(ctx, tool...)
		record(t, rules, p, float64(strings.Count(out, "\n")), err)
	}
	rules.Note(PathKUP, "iptables-save of its node")
	rss.Note(PathIPTables, "not restarted: grown")
	rss.Note(PathNFTables, "not restarted: grown")
	saveHeapProfile(t, nodes[PathKUP].NS, filepath.Join(os.TempDir(), "kup-churn-heap.pb.gz"))

	// The churn.
	before := map[string]map[string]float64{}
	for _, p := range ChurnPaths {
		before[p] = scrape(p)
	}
	stopProbes := probeAll(ctx, nodes, probeSvc)
	stopWatch := watchDelivery(ctx, t, c)
	ticks := map[string]float64{}
	for _, p := range ChurnPaths {
		ticks[p] = cpuTicks(pids[p])
	}
	peak := map[string]int64{}
	type event struct {
		at  time.Time
		pod string
	}
	var added, removed []event
	r := rand.New(rand.NewPCG(1, 2))
	// rolling[i] is bulk service i's next step (0: oldest terminating, 1: new one not ready,
	// 2: ready, 3: terminating one gone) and its first endpoint.
	type roll struct{ step, first int }
	rolling := map[int]*roll{}
	every := time.Duration(float64(time.Second) / cfg.rate)
	churnStart := time.Now()
	scaleUp := rep.Metric("scale-up 10 → 1,000, first connection to a new endpoint", "ms", false)
	scaleDown := rep.Metric("scale-down 1,000 → 10, last connection to a removed endpoint", "ms", false)
	var scaling sync.WaitGroup
	scaling.Go(func() {
		for k, svc := range bigSvcs {
			// Spread over the churn: up at (2k+1)/(2n+1) of it, down 10 s later.
			time.Sleep(time.Until(churnStart.Add(cfg.duration * time.Duration(2*k+1) / time.Duration(2*len(bigSvcs)+1))))
			scaleOnce(t, c, nodes, svc, scaleUp, scaleDown)
		}
	})
	nextProbe, probeStep, fresh := churnStart.Add(cfg.probeEvery), 0, 3
	updates := 0
	for tick := churnStart; time.Since(churnStart) < cfg.duration; tick = tick.Add(every) {
		time.Sleep(time.Until(tick))
		if time.Now().After(nextProbe) {
			// One step of the probe's rolling update per tick (it counts in the rate).
			switch probeStep {
			case 0:
				harness.ApplySlice(ctx, t, c.Client, probeSlice(active[1:], -1, active[0]))
				removed = append(removed, event{time.Now(), probe[active[0]].Name})
			case 1:
				harness.ApplySlice(ctx, t, c.Client, probeSlice(active[1:], fresh, active[0]))
			case 2:
				w := time.Now()
				harness.ApplySlice(ctx, t, c.Client, probeSlice(slices.Concat(active[1:], []int{fresh}), -1, active[0]))
				added = append(added, event{w, probe[fresh].Name})
			case 3:
				active = slices.Concat(active[1:], []int{fresh})
				fresh = (fresh + 1) % probePods
				harness.ApplySlice(ctx, t, c.Client, probeSlice(active, -1, -1))
				nextProbe = time.Now().Add(cfg.probeEvery)
			}
			probeStep = (probeStep + 1) % 4
			updates++
			continue
		}
		i := r.IntN(cfg.services)
		ro := rolling[i]
		if ro == nil {
			ro = &roll{}
			rolling[i] = ro
		}
		var s *discoveryv1.EndpointSlice
		switch ro.step {
		case 0:
			s = bulkSlice(bulk[i], i, ro.first, cfg.endpoints, -1, 0)
		case 1:
			s = bulkSlice(bulk[i], i, ro.first, cfg.endpoints+1, cfg.endpoints, 0)
		case 2:
			s = bulkSlice(bulk[i], i, ro.first, cfg.endpoints+1, -1, 0)
		case 3:
			ro.first++
			s = bulkSlice(bulk[i], i, ro.first, cfg.endpoints, -1, -1)
		}
		ro.step = (ro.step + 1) % 4
		harness.ApplySlice(ctx, t, c.Client, s)
		updates++
		if updates%int(cfg.rate) == 0 {
			for _, p := range ChurnPaths {
				if kib, err := rssKiB(pids[p]); err == nil && kib > peak[p] {
					peak[p] = kib
				}
			}
		}
	}
	took := time.Since(churnStart)
	scaling.Wait()
	cpu := rep.Metric("proxy CPU during the churn", "% of a core", false)
	for _, p := range ChurnPaths {
		cpu.Add(p, (cpuTicks(pids[p])-ticks[p])/100/took.Seconds()*100)
	}
	time.Sleep(2 * time.Second) // the last changes are programmed
	conns := stopProbes()
	delivery := stopWatch()
	t.Logf("churn: %d slice updates in %v (%.1f/s)", updates, took.Round(time.Millisecond), float64(updates)/took.Seconds())

	mean := rep.Metric("programming latency, mean (metric)", "ms", false)
	within := rep.Metric("programming latency ≤ 0.25 s (metric)", "% of changes", true)
	for _, p := range ChurnPaths {
		after := scrape(p)
		n := after[npCount] - before[p][npCount]
		if n <= 0 {
			mean.Note(p, "no observation")
			continue
		}
		mean.Add(p, (after[npSum]-before[p][npSum])/n*1000)
		within.Add(p, (after[npLE025]-before[p][npLE025])/n*100)
	}
	// The quantiles: kube-userspace-proxy's from its fine histogram (the same observations in
	// buckets from 1 ms), the kube-proxies' from theirs (from 0.25 s).
	afterAll := map[string]map[string]float64{}
	for _, p := range ChurnPaths {
		afterAll[p] = scrape(p)
	}
	for _, q := range []struct {
		name string
		q    float64
	}{{"p50", 0.5}, {"p99", 0.99}, {"max", 1}} {
		m := rep.Metric("programming latency "+q.name+" (metric, histogram_quantile)", "ms", false)
		for _, p := range ChurnPaths {
			hist := npHist
			if p == PathKUP {
				hist = npFineHist
			}
			if v, ok := histQuantile(hist, before[p], afterAll[p], q.q); ok {
				m.Add(p, v*1000)
			}
			if p == PathKUP {
				m.Note(p, "fine histogram")
			}
		}
	}
	peakRSS := rep.Metric("RSS during the churn, peak", "MiB", false)
	for _, p := range ChurnPaths {
		peakRSS.Add(p, float64(peak[p])/1024)
	}
	// Client side: the first connection that reached a new endpoint after its slice was
	// written, the last one that reached an endpoint after its becoming terminating was written.
	first := map[string][]float64{}
	last := map[string][]float64{}
	for _, p := range ChurnPaths {
		for _, ev := range added {
			for _, cn := range conns[p] {
				if cn.at.After(ev.at) && cn.backend == ev.pod {
					first[p] = append(first[p], float64(cn.at.Sub(ev.at).Microseconds())/1e3)
					break
				}
			}
		}
		for _, ev := range removed {
			// Until the pod is added again (the probe's pods take turns).
			until := time.Now()
			for _, a := range added {
				if a.pod == ev.pod && a.at.After(ev.at) {
					until = a.at
					break
				}
			}
			lastAt := 0.0
			for _, cn := range conns[p] {
				if cn.at.After(ev.at) && cn.at.Before(until) && cn.backend == ev.pod {
					lastAt = float64(cn.at.Sub(ev.at).Microseconds()) / 1e3
				}
			}
			last[p] = append(last[p], lastAt)
		}
	}
	// The client's pacing: a new endpoint is reached by the first connection that begins after
	// it is programmed and that the proxy sends to it, so the client-side figures include up to
	// one interval of waiting for the next connection, plus the connections the rotation sends
	// to the other endpoints first (up to 2 with the probe's 3 ready pods, under round robin).
	interval := map[string][]float64{}
	for _, p := range ChurnPaths {
		for k := 1; k < len(conns[p]); k++ {
			interval[p] = append(interval[p], float64(conns[p][k].at.Sub(conns[p][k-1].at).Microseconds())/1e3)
		}
	}
	for _, q := range []struct {
		name string
		pct  float64
	}{{"p50", 50}, {"p99", 99}} {
		m := rep.Metric("client probe interval "+q.name+" (between answered connections' starts)", "ms", false)
		for _, p := range ChurnPaths {
			if len(interval[p]) > 0 {
				m.Add(p, percentile(interval[p], q.pct))
			}
		}
	}
	for _, q := range []struct {
		name string
		pct  float64
	}{{"p50", 50}, {"p99", 99}, {"max", 100}} {
		mf := rep.Metric("programming latency "+q.name+" (client: first connection to a new endpoint)", "ms", false)
		ml := rep.Metric("programming latency "+q.name+" (client: last connection to a terminating endpoint)", "ms", false)
		for _, p := range ChurnPaths {
			if len(first[p]) > 0 {
				mf.Add(p, percentile(first[p], q.pct))
			}
			if len(last[p]) > 0 {
				ml.Add(p, percentile(last[p], q.pct))
			}
		}
	}
	if len(delivery) > 0 {
		rep.Notes = append(rep.Notes, fmt.Sprintf("Watch delivery alone (the bench's own watch of every EndpointSlice, from each slice's trigger time to the event's arrival, no proxy): p50 %s ms, p99 %s ms, max %s ms over %d events; the rest of a proxy's metric is its own work (decoding, the handler, programming).",
			num(percentile(delivery, 50)), num(percentile(delivery, 99)), num(percentile(delivery, 100)), len(delivery)))
	}
	rep.Notes = append(rep.Notes,
		fmt.Sprintf("One control plane (etcd + kube-apiserver) and one node namespace per path, all watching it: upstream kube-proxy v1.36.3 --proxy-mode=iptables, the same with --proxy-mode=nftables, kube-userspace-proxy; every proxy with its default minimum sync period (1 s). The bulk: %d ClusterIP services of %d endpoints each (one slice per service; addresses nowhere: no traffic goes to them), created through the API server after the proxies started; RSS grown from none once every proxy had programmed every slice; then kube-userspace-proxy restarted with the bulk present, and RSS and rules 10 s after it served again (the churn runs on the restarted proxy); the kube-proxies are not restarted (kube-proxy in iptables mode did not finish its first sync after a restart at 100,000 endpoints within 15 minutes here), so their RSS row is the grown process's.", cfg.services, cfg.endpoints),
		fmt.Sprintf("Churn: %.0f EndpointSlice updates/s for %v, each one step of a rolling update of a random service (oldest endpoint terminating; a new one not ready; ready; the terminating one removed), every slice written with endpoints.kubernetes.io/last-change-trigger-time = now, as the EndpointSlice controller does. CPU: utime+stime of each proxy over the churn (kube-userspace-proxy's includes relaying the probe client's connections, which the kernel does for kube-proxy); RSS peak sampled every second.", cfg.rate, cfg.duration),
		"Metric: kubeproxy_network_programming_duration_seconds over the churn (from each slice's trigger time to the end of the programming); kube-proxy's buckets start at 0.25 s, so the metric gives the mean (sum/count), the share within 0.25 s, and histogram_quantile's estimates (linear within a bucket: any p99 in the first bucket reads about 0.25 s; max is the upper bound of the highest bucket reached). kube-userspace-proxy's p50/p99/max rows (noted \"fine histogram\") come from kube_userspace_proxy_network_programming_duration_seconds, the same observations in buckets from 1 ms, each about √2 times the last; the kube-proxies' from kubeproxy_network_programming_duration_seconds. Client: a probe service of 6 real pods (kup-echo) is rolled every few seconds (its updates count in the rate); a client on each node connects to its ClusterIP without pause; first connection = the first that reached the new pod after its ready slice was written; last connection = the last that reached the pod after the slice making it terminating was written (0 when none did).",
	)
}

// The large services' endpoint addresses: bigOldRange holds the 10 they keep, bigNewRange the
// 990 of a scale-up; bigRange covers both.
const (
	bigRange    = "10.210.0.0/16"
	bigOldRange = "10.210.0.0/28"
	bigNewRange = "10.210.4.0/22"
)

// watchDelivery watches every EndpointSlice with the bench's own client until the returned
// function is called; that function stops the watch, waits for its reader, and returns for each
// added or modified slice with a trigger time how long after it the event arrived (ms): what the
// API server's write and watch take, without any proxy's work.
func watchDelivery(ctx context.Context, t *testing.T, c *cluster.Cluster) (stop func() []float64) {
	ctx, cancel := context.WithCancel(ctx)
	api := c.Client.DiscoveryV1().EndpointSlices("")
	list, err := api.List(ctx, metav1.ListOptions{Limit: 1})
	var w watch.Interface
	if err == nil {
		w, err = api.Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
	}
	if err != nil {
		cancel()
		t.Logf("watch delivery: %v", err)
		return func() []float64 { return nil }
	}
	var took []float64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ev := range w.ResultChan() {
			at := time.Now()
			s, ok := ev.Object.(*discoveryv1.EndpointSlice)
			if !ok || ev.Type == watch.Deleted {
				continue
			}
			if tt, err := time.Parse(time.RFC3339Nano, s.Annotations[corev1.EndpointsLastChangeTriggerTime]); err == nil {
				took = append(took, float64(at.Sub(tt).Microseconds())/1e3)
			}
		}
	}()
	return func() []float64 {
		w.Stop()
		cancel()
		<-done
		return took
	}
}

// probeConn is one answered connection of probeAll: when it began, and the backend that answered.
type probeConn struct {
	at      time.Time
	backend string
}

// probeAll connects to svc's first port from every ChurnPaths node every 5 ms, each path from a
// goroutine of its own, until the returned function is called; that function stops the probes,
// waits for them, and returns each path's answered connections in the order they began.
func probeAll(ctx context.Context, nodes map[string]*netns.Node, svc *corev1.Service) (stop func() map[string][]probeConn) {
	var mu sync.Mutex
	conns := map[string][]probeConn{}
	done := make(chan struct{})
	var clients sync.WaitGroup
	for _, p := range ChurnPaths {
		clients.Go(func() {
			for {
				select {
				case <-done:
					return
				default:
				}
				at := time.Now()
				if a, err := harness.AskTimeout(ctx, nodes[p].NS, "tcp", harness.Addr(svc, 0), 2*time.Second); err == nil {
					mu.Lock()
					conns[p] = append(conns[p], probeConn{at, a.Backend})
					mu.Unlock()
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
	return func() map[string][]probeConn {
		close(done)
		clients.Wait()
		return conns
	}
}

// bigSlice returns slice number k of the large service svc: old endpoints of bigOldRange, then
// fresh ones of bigNewRange from its index from.
func bigSlice(svc *corev1.Service, k, old, from, fresh int) *discoveryv1.EndpointSlice {
	var eps []harness.Endpoint
	for i := range old {
		eps = append(eps, harness.Endpoint{IP: netip.AddrFrom4([4]byte{10, 210, 0, byte(i)})})
	}
	for i := from; i < from+fresh; i++ {
		eps = append(eps, harness.Endpoint{IP: netip.AddrFrom4([4]byte{10, 210, byte(4 + i/256), byte(i % 256)})})
	}
	s := harness.Slice(svc, eps...)
	s.Name = fmt.Sprintf("%s-%d", svc.Name, k)
	return s
}

// scaleOnce scales svc from 10 endpoints to 1,000 (10 slices of 100) and back, while a client
// on each path's node connects to it without pause, and records the first connection that
// reached a new endpoint after the first slice was written, and the last that reached one after
// the scale-down began.
func scaleOnce(t *testing.T, c *cluster.Cluster, nodes map[string]*netns.Node, svc *corev1.Service, up, down *Metric) {
	ctx := context.Background()
	stopProbes := probeAll(ctx, nodes, svc)
	time.Sleep(500 * time.Millisecond)
	upAt := time.Now()
	harness.ApplySlice(ctx, t, c.Client, bigSlice(svc, 0, 10, 0, 90))
	for k := 1; k < 10; k++ {
		harness.ApplySlice(ctx, t, c.Client, bigSlice(svc, k, 0, 90+(k-1)*100, 100))
	}
	time.Sleep(10 * time.Second)
	downAt := time.Now()
	harness.ApplySlice(ctx, t, c.Client, bigSlice(svc, 0, 10, 0, 0))
	for k := 1; k < 10; k++ {
		name := fmt.Sprintf("%s-%d", svc.Name, k)
		if err := c.Client.DiscoveryV1().EndpointSlices(svc.Namespace).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Errorf("delete endpointslice %s: %v", name, err)
		}
	}
	time.Sleep(5 * time.Second)
	conns := stopProbes()
	for _, p := range ChurnPaths {
		first, last := -1.0, 0.0
		for _, cn := range conns[p] {
			if cn.backend != "bignew" {
				continue
			}
			if d := float64(cn.at.Sub(upAt).Microseconds()) / 1e3; first < 0 && cn.at.After(upAt) {
				first = d
			}
			if cn.at.After(downAt) {
				last = float64(cn.at.Sub(downAt).Microseconds()) / 1e3
			}
		}
		if first < 0 {
			up.Note(p, "no connection reached a new endpoint")
		} else {
			up.Add(p, first)
		}
		down.Add(p, last)
	}
}

// histQuantile returns the q-quantile of the IPv4 observations of histogram hist made between
// the scrapes before and after, as Prometheus's histogram_quantile estimates it from the buckets
// (linear within a bucket); q = 1 gives the upper bound of the highest bucket that got one.
func histQuantile(hist string, before, after map[string]float64, q float64) (float64, bool) {
	prefix := hist + `_bucket{ip_family="IPv4",le="`
	type bucket struct{ le, n float64 }
	var bs []bucket
	for k, v := range after {
		le, ok := strings.CutPrefix(k, prefix)
		if !ok {
			continue
		}
		le = strings.TrimSuffix(le, `"}`)
		var f float64
		if le == "+Inf" {
			f = math.Inf(1)
		} else if _, err := fmt.Sscan(le, &f); err != nil {
			continue
		}
		bs = append(bs, bucket{f, v - before[k]})
	}
	slices.SortFunc(bs, func(a, b bucket) int { return cmp.Compare(a.le, b.le) })
	if len(bs) == 0 || bs[len(bs)-1].n <= 0 {
		return 0, false
	}
	total := bs[len(bs)-1].n
	if q >= 1 {
		for i, b := range bs {
			if b.n >= total {
				if math.IsInf(b.le, 1) && i > 0 {
					return bs[i-1].le, true
				}
				return b.le, true
			}
		}
	}
	rank, lo, below := q*total, 0.0, 0.0
	for _, b := range bs {
		if b.n >= rank {
			if math.IsInf(b.le, 1) {
				return lo, true
			}
			return lo + (b.le-lo)*(rank-below)/(b.n-below), true
		}
		lo, below = b.le, b.n
	}
	return lo, true
}

// saveHeapProfile writes kube-userspace-proxy's heap profile (its --profiling endpoint in ns)
// to file, for the figures' explanation; a failure is logged, not fatal.
func saveHeapProfile(t *testing.T, ns *netns.NS, file string) {
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: ns.DialContext, DisableKeepAlives: true}}
	resp, err := hc.Get("http://" + metricsAddr + "/debug/pprof/heap?gc=1")
	if err == nil {
		defer resp.Body.Close()
		var b []byte
		if b, err = io.ReadAll(resp.Body); err == nil {
			err = os.WriteFile(file, b, 0o644)
		}
	}
	if err != nil {
		t.Logf("heap profile: %v", err)
		return
	}
	t.Logf("kube-userspace-proxy's heap profile after the bulk: %s", file)
}

// cpuTicks returns utime+stime of pid in clock ticks (0 if it cannot be read).
func cpuTicks(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndex(s, ")")+2:])
	var u, k float64
	fmt.Sscan(f[11], &u)
	fmt.Sscan(f[12], &k)
	return u + k
}

// thousands formats n with a comma every three digits.
func thousands(n int) string {
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// writeChurnReport writes churn.md and churn.json into dir.
func writeChurnReport(t *testing.T, rep *ChurnReport, dir string) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Errorf("results: %v", err)
		return
	}
	var md strings.Builder
	_ = rep.WriteMarkdown(&md)
	fmt.Println(md.String())
	if err := os.WriteFile(filepath.Join(dir, "churn.md"), []byte(md.String()), 0o644); err != nil {
		t.Errorf("results: %v", err)
	}
	f, err := os.Create(filepath.Join(dir, "churn.json"))
	if err == nil {
		err = rep.WriteJSON(f)
		err = cmpErr(err, f.Close())
	}
	if err != nil {
		t.Errorf("results churn.json: %v", err)
	}
}
