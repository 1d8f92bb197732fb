//go:build linux && scalemeasure

// The scale measurements, outside `make test` (they take minutes and assert no timing):
// `make scale-measure`, or go test -tags scalemeasure -run TestScaleMeasure -v ./test/e2e/.

package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// TestScaleMeasure measures, for each service count in KUP_SCALE_MEASURE (default
// 5000,10000,20000), from a manifests
// directory and iptables portals in a node namespace: process start → every sampled service
// answering, the first full sync (metric), RSS and open descriptors once serving, idle CPU over
// KUP_SCALE_CPU_WINDOW (default 30s, the default sync period; after the first periodic sync), and one more service → its first
// answer (and → the source's log line that it loaded the file, polled every 10 ms); and process start → the manifests source's initial delivery (its log line), the
// source's share of the start. It logs one MEASURE line per count; it asserts nothing about
// timing. With KUP_SCALE_PROFILE=dir it runs the proxy with --profiling and writes to dir a CPU
// profile of its first 8 s, a heap profile once it serves, and its log; KUP_SCALE_ARGS adds
// flags to the proxy's command line (say --log-level=debug), and KUP_SCALE_IDLE_PROFILE=1 takes a
// CPU profile of 9 s of the idle window too, and a heap profile at each end of it, each after a
// collection (a heap profile is as of the last one), so that pprof -diff_base shows what the
// idle window allocated, and KUP_SCALE_CHURN_PROFILE=k adds k more services one at a time after
// the measurements under a CPU profile (k/4 seconds); the profiling counts in that run's idle CPU figure. With KUP_SCALE_OUT=dir it writes
// the figures as a table (scale.md) and as growth curves (scale.svg) to dir; KUP_SCALE_REPS=k
// measures every count k times (interleaved) and reports the medians.
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
	reps := 1
	if r := os.Getenv("KUP_SCALE_REPS"); r != "" {
		var err error
		if reps, err = strconv.Atoi(r); err != nil || reps < 1 {
			t.Fatalf("KUP_SCALE_REPS=%q: want a count ≥ 1", r)
		}
	}
	var counts []int
	for _, s := range strings.Split(spec, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			t.Fatal(err)
		}
		counts = append(counts, n)
	}
	runs := map[int][]scaleFigures{}
	for rep := range reps {
		for _, n := range counts {
			t.Run(fmt.Sprintf("%d/rep%d", n, rep+1), func(t *testing.T) {
				runs[n] = append(runs[n], measureScale(t, n, window))
			})
		}
	}
	var figs []scaleFigures
	for _, n := range counts {
		for _, f := range runs[n] {
			t.Log(f.line)
		}
		if len(runs[n]) > 0 {
			figs = append(figs, medianFigures(runs[n]))
		}
	}
	if out := os.Getenv("KUP_SCALE_OUT"); out != "" {
		if err := writeScaleReport(out, figs, window, reps); err != nil {
			t.Error(err)
		}
	}
}

// medianFigures returns, field by field, the median of one count's repetitions (the upper
// median of an even number).
func medianFigures(rs []scaleFigures) scaleFigures {
	med := func(get func(scaleFigures) float64) float64 {
		v := make([]float64, len(rs))
		for i, r := range rs {
			v[i] = get(r)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	dur := func(get func(scaleFigures) time.Duration) time.Duration {
		return time.Duration(med(func(f scaleFigures) float64 { return float64(get(f)) }))
	}
	return scaleFigures{n: rs[0].n,
		source:        dur(func(f scaleFigures) time.Duration { return f.source }),
		all:           dur(func(f scaleFigures) time.Duration { return f.all }),
		firstSync:     dur(func(f scaleFigures) time.Duration { return f.firstSync }),
		oneMore:       dur(func(f scaleFigures) time.Duration { return f.oneMore }),
		oneLoaded:     dur(func(f scaleFigures) time.Duration { return f.oneLoaded }),
		rssMiB:        med(func(f scaleFigures) float64 { return f.rssMiB }),
		cpu:           med(func(f scaleFigures) float64 { return f.cpu }),
		fds:           int(med(func(f scaleFigures) float64 { return float64(f.fds) })),
		neverAnswered: int(med(func(f scaleFigures) float64 { return float64(f.neverAnswered) })),
		unservable:    int(med(func(f scaleFigures) float64 { return float64(f.unservable) })),
	}
}

// scaleFigures are one service count's measurements.
type scaleFigures struct {
	n                               int
	source, all, firstSync, oneMore time.Duration
	oneLoaded                       time.Duration
	rssMiB, cpu                     float64
	fds, neverAnswered, unservable  int
	line                            string
}

func measureScale(t *testing.T, n int, window time.Duration) scaleFigures {
	e := newScaleEnv(t, fmt.Sprintf("sm%d", n/1000), n)
	profDir := os.Getenv("KUP_SCALE_PROFILE")
	args := strings.Fields(os.Getenv("KUP_SCALE_ARGS"))
	if profDir != "" {
		args = append(args, "--profiling")
	}
	started := time.Now()
	p := e.start(t, args...)
	pid := p.Pid()
	var startProfile <-chan error
	if profDir != "" {
		startProfile = fetchProfile(e.node.NS, "profile?seconds=8", filepath.Join(profDir, fmt.Sprintf("start-cpu-%d.pprof", n)))
	}
	delivered := watchLog(p, "initial scan delivered", 40*time.Second)
	type syncTime struct {
		d   time.Duration
		err error
	}
	firstFull := make(chan syncTime, 1)
	go func() { // from the start: waitAll may outlast the first periodic sync
		d, err := firstFullSync(e.node.NS, time.Minute)
		firstFull <- syncTime{d, err}
	}()
	last, missing := waitAll(e.node.NS, sampleIndexes(n, 200), 40*time.Second)
	all := sinceOrNever(started, last)
	source := sinceOrNever(started, <-delivered)
	fs := <-firstFull
	full := fs.d
	if fs.err != nil {
		t.Log(fs.err)
	}
	time.Sleep(2 * time.Second)
	if profDir != "" {
		if err := <-startProfile; err != nil {
			t.Log(err)
		}
		if err := <-fetchProfile(e.node.NS, "heap", filepath.Join(profDir, fmt.Sprintf("heap-%d.pprof", n))); err != nil {
			t.Log(err)
		}
		if err := <-fetchProfile(e.node.NS, "heap?debug=1", filepath.Join(profDir, fmt.Sprintf("memstats-%d.txt", n))); err != nil {
			t.Log(err)
		}
	}
	rss, _ := procStatusKiB(pid, "VmRSS")
	rssAnon, _ := procStatusKiB(pid, "RssAnon") // the rest is mapped files: the binary's pages
	fds, _ := openFDs(pid)
	// Idle CPU in the steady state: after the first periodic sync, which checks every service's
	// endpoints against the proxy's own addresses once (the listeners opened since are new
	// addresses); the window then holds one more periodic sync, as any 30 s of an idle proxy.
	waitFullSyncs(e.node.NS, 2, 45*time.Second)
	a0 := time.Now()
	a, _ := cpuTicks(pid)
	if profDir != "" && os.Getenv("KUP_SCALE_IDLE_PROFILE") != "" { // in the window: counts in its figure
		if err := <-fetchProfile(e.node.NS, "heap?gc=1", filepath.Join(profDir, fmt.Sprintf("idle-heap-start-%d.pprof", n))); err != nil {
			t.Log(err)
		}
		if err := <-fetchProfile(e.node.NS, "profile?seconds=9", filepath.Join(profDir, fmt.Sprintf("idle-cpu-%d.pprof", n))); err != nil {
			t.Log(err)
		}
	}
	time.Sleep(window - min(window, time.Since(a0)))
	b, _ := cpuTicks(pid)
	if profDir != "" && os.Getenv("KUP_SCALE_IDLE_PROFILE") != "" { // what the idle window allocated: pprof -diff_base
		if err := <-fetchProfile(e.node.NS, "heap?gc=1", filepath.Join(profDir, fmt.Sprintf("idle-heap-end-%d.pprof", n))); err != nil {
			t.Log(err)
		}
	}
	cpu := (b - a) / window.Seconds() // ticks/s = percent of a core
	// One more service, written once the periodic sync due at the window's end (the window is a
	// sync period long) has run: written during it, the service waited for it, up to its whole
	// duration (a full check of every rule, ~0.1 s at 10,000), which a change meets about once
	// in (period / full sync) changes, not every time.
	waitFullSyncs(e.node.NS, 3, 45*time.Second)
	writeScaleManifests(t, e.dir, n, n+1, e.pod.IP)
	added := time.Now()
	loaded := watchLog(p, fmt.Sprintf("svc-%06d.yaml", n), 30*time.Second) // the source's "manifest file loaded"
	lastOne := firstServiceAnswer(e.node.NS, n, 30*time.Second)
	miss1 := 0
	if lastOne.IsZero() {
		miss1 = 1
	}
	oneMore := sinceOrNever(added, lastOne)
	oneLoaded := sinceOrNever(added, <-loaded)
	if k, _ := strconv.Atoi(os.Getenv("KUP_SCALE_CHURN_PROFILE")); profDir != "" && k > 0 {
		// k more services, one at a time, under a CPU profile: where a partial sync's time goes.
		secs := max(1, k/4)
		prof := fetchProfile(e.node.NS, fmt.Sprintf("profile?seconds=%d", secs), filepath.Join(profDir, fmt.Sprintf("churn-cpu-%d.pprof", n)))
		deadline := time.Now().Add(time.Duration(secs) * time.Second)
		for i := 1; i <= k && time.Now().Before(deadline); i++ {
			writeScaleManifests(t, e.dir, n+i, n+i+1, e.pod.IP)
			firstServiceAnswer(e.node.NS, n+i, 10*time.Second)
			time.Sleep(100 * time.Millisecond)
		}
		if err := <-prof; err != nil {
			t.Log(err)
		}
	}
	m, _ := harness.ScrapeMetrics(e.node.NS, scaleMetricsAddr)
	if profDir != "" {
		if err := os.WriteFile(filepath.Join(profDir, fmt.Sprintf("proxy-%d.log", n)), []byte(p.Log()), 0o644); err != nil {
			t.Log(err)
		}
		for _, table := range []string{"filter", "nat"} { // what each partial sync's restore works on
			if out, err := e.node.NS.Exec(context.Background(), "iptables-save", "-t", table); err != nil {
				t.Log(err)
			} else if err := os.WriteFile(filepath.Join(profDir, fmt.Sprintf("%s-%d.rules", table, n)), []byte(out), 0o644); err != nil {
				t.Log(err)
			}
		}
	}
	line := fmt.Sprintf("MEASURE n=%d start→source-delivered=%v start→all-answering=%v (sample 200, %d never) first-full-sync=%v RSS=%.1fMiB (anon %.1f) fds=%d idle-CPU=%.2f%% (%v) one-more→answer=%v (missed %d, source loaded it after %v) unservable=%v",
		n, source.Round(10*time.Millisecond), all.Round(time.Millisecond), missing, full.Round(time.Millisecond), float64(rss)/1024, float64(rssAnon)/1024, fds, cpu, window,
		oneMore.Round(time.Millisecond), miss1, oneLoaded.Round(time.Millisecond), m["kube_userspace_proxy_service_ports_unservable"])
	t.Log(line)
	if tail := p.Tail(5); strings.Contains(tail, "panic") {
		t.Errorf("proxy log:\n%s", tail)
	}
	return scaleFigures{n: n, source: source, all: all, firstSync: full, oneMore: oneMore, oneLoaded: oneLoaded,
		rssMiB: float64(rss) / 1024, cpu: cpu, fds: fds, neverAnswered: missing,
		unservable: int(m["kube_userspace_proxy_service_ports_unservable"]), line: line}
}

// writeScaleTargets appends the scale targets at 10,000 service ports (when measured), met or
// not, and the growth per doubling of the service ports measured.
func writeScaleTargets(md *strings.Builder, figs []scaleFigures) {
	byN := map[int]scaleFigures{}
	for _, f := range figs {
		byN[f.n] = f
	}
	yes := func(ok bool) string {
		if ok {
			return "yes"
		}
		return "no"
	}
	if f, ok := byN[10000]; ok {
		md.WriteString("\n## Targets at 10,000 service ports (medians above)\n\n| target | measured | met |\n|---|---|---|\n")
		fmt.Fprintf(md, "| start → every service answering ≤ 3 s | %v | %s |\n", f.all.Round(10*time.Millisecond), yes(f.neverAnswered == 0 && f.all <= 3*time.Second))
		fmt.Fprintf(md, "| first full sync ≤ 1 s | %v | %s |\n", f.firstSync.Round(10*time.Millisecond), yes(f.firstSync <= time.Second))
		fmt.Fprintf(md, "| one more service → first answer ≤ 100 ms | %v | %s |\n", f.oneMore.Round(time.Millisecond), yes(f.oneMore > 0 && f.oneMore <= 100*time.Millisecond))
		fmt.Fprintf(md, "| RSS ≤ 100 MB (95.4 MiB) | %.1f MiB | %s |\n", f.rssMiB, yes(f.rssMiB <= 100e6/(1<<20)))
		fmt.Fprintf(md, "| idle CPU ≤ 0.2 %% of a core | %.2f %% | %s |\n", f.cpu, yes(f.cpu <= 0.2))
	}
	md.WriteString("\nGrowth per doubling of the service ports (2.0 = linear; the 20,000 step serves only the ports the descriptor limit allows, see unservable):\n\n| step | start → every service answering | first full sync | RSS |\n|---|---|---|---|\n")
	for _, f := range figs {
		g, ok := byN[2*f.n]
		if !ok || f.all <= 0 || f.firstSync <= 0 || f.rssMiB <= 0 {
			continue
		}
		fmt.Fprintf(md, "| %d → %d | ×%.2f | ×%.2f | ×%.2f |\n", f.n, g.n, g.all.Seconds()/f.all.Seconds(),
			g.firstSync.Seconds()/f.firstSync.Seconds(), g.rssMiB/f.rssMiB)
	}
}

// writeScaleReport writes figs to dir as scale.md (a table) and scale.svg (one panel per figure,
// service ports across, each measured point joined, and a dotted line through the origin and
// the first point: what linear growth would give).
func writeScaleReport(dir string, figs []scaleFigures, window time.Duration, reps int) error {
	if len(figs) == 0 {
		return nil
	}
	var md strings.Builder
	fmt.Fprintf(&md, "# kube-userspace-proxy at scale (make scale-measure)\n\nRun %s. Services of one TCP port and one endpoint each, "+
		"from a manifests directory (1,000 services per file), iptables portals in one node namespace, open-files limit of the machine. "+
		"Idle CPU over %v after the first periodic sync. Each figure the median of %d runs.\n\n", time.Now().UTC().Format(time.RFC3339), window, reps)
	md.WriteString("| service ports | start → source delivered | start → every service answering | first full sync | one more service → answer (source loaded it) | RSS | idle CPU | open descriptors | unservable (descriptor limit) |\n|---|---|---|---|---|---|---|---|---|\n")
	for _, f := range figs {
		all := f.all.Round(10 * time.Millisecond).String()
		if f.neverAnswered > 0 {
			all += fmt.Sprintf(" (%d of the 200 sampled never: beyond the descriptor limit)", f.neverAnswered)
		}
		oneMore := f.oneMore.Round(time.Millisecond).String()
		if f.oneMore <= 0 {
			oneMore = "— (beyond the descriptor limit)"
		}
		fmt.Fprintf(&md, "| %d | %v | %s | %v | %s (%v) | %.0f MiB | %.2f %% | %d | %d |\n", f.n, f.source.Round(10*time.Millisecond),
			all, f.firstSync.Round(10*time.Millisecond), oneMore, f.oneLoaded.Round(time.Millisecond), f.rssMiB, f.cpu, f.fds, f.unservable)
	}
	writeScaleTargets(&md, figs)
	if err := os.WriteFile(filepath.Join(dir, "scale.md"), []byte(md.String()), 0o644); err != nil {
		return err
	}
	panels := []struct {
		title, unit string
		value       func(scaleFigures) float64
	}{
		{"start → every service answering", "s", func(f scaleFigures) float64 { return f.all.Seconds() }},
		{"first full sync", "s", func(f scaleFigures) float64 { return f.firstSync.Seconds() }},
		{"RSS", "MiB", func(f scaleFigures) float64 { return f.rssMiB }},
		{"one more service → answer", "ms", func(f scaleFigures) float64 { return float64(f.oneMore.Milliseconds()) }},
	}
	const pw, ph, pad = 260.0, 180.0, 40.0
	maxN := 0
	for _, f := range figs {
		maxN = max(maxN, f.n)
	}
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="10">`+"\n",
		float64(len(panels))*(pw+pad)+pad, ph+2*pad)
	for i, pn := range panels {
		x0, y0 := pad+float64(i)*(pw+pad), pad
		top := 0.0
		for _, f := range figs {
			top = max(top, pn.value(f), pn.value(figs[0])*float64(f.n)/float64(figs[0].n))
		}
		if top == 0 {
			top = 1
		}
		top *= 1.1
		px := func(n int) float64 { return x0 + pw*float64(n)/float64(maxN) }
		py := func(v float64) float64 { return y0 + ph - ph*v/top }
		fmt.Fprintf(&b, `<text x="%.0f" y="%.0f" font-weight="bold">%s (%s)</text>`+"\n", x0, y0-12, pn.title, pn.unit)
		fmt.Fprintf(&b, `<path d="M%.1f %.1f V%.1f H%.1f" fill="none" stroke="#888"/>`+"\n", x0, y0, y0+ph, x0+pw)
		fmt.Fprintf(&b, `<text x="%.0f" y="%.0f">%.3g</text><text x="%.0f" y="%.0f">0</text>`+"\n", x0-pad+4, y0+8, top, x0-12, y0+ph)
		f0 := figs[0]
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#999" stroke-dasharray="3,3"/>`+"\n",
			px(0), py(0), px(maxN), py(pn.value(f0)*float64(maxN)/float64(f0.n)))
		var path strings.Builder
		for _, f := range figs {
			if pn.value(f) <= 0 {
				continue // not measured (the service was beyond the descriptor limit)
			}
			cmd := "L"
			if path.Len() == 0 {
				cmd = "M"
			}
			fmt.Fprintf(&path, "%s%.1f %.1f ", cmd, px(f.n), py(pn.value(f)))
			fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="#c33"/><text x="%.1f" y="%.1f" text-anchor="middle">%.3g</text>`+"\n",
				px(f.n), py(pn.value(f)), px(f.n), py(pn.value(f))-6, pn.value(f))
			fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%d</text>`+"\n", px(f.n), y0+ph+12, f.n)
		}
		fmt.Fprintf(&b, `<path d="%s" fill="none" stroke="#c33"/>`+"\n", strings.TrimSpace(path.String()))
	}
	fmt.Fprintf(&b, `<text x="%.0f" y="%.0f">service ports (dotted: linear growth from the first point)</text>`+"\n", pad, ph+2*pad-6)
	b.WriteString("</svg>\n")
	return os.WriteFile(filepath.Join(dir, "scale.svg"), []byte(b.String()), 0o644)
}

// waitFullSyncs waits until the proxy has counted n full syncs (or timeout).
func waitFullSyncs(ns *netns.NS, n float64, timeout time.Duration) {
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if m, err := harness.ScrapeMetrics(ns, scaleMetricsAddr); err == nil && m["kubeproxy_sync_full_proxy_rules_duration_seconds_count"] >= n {
			return
		}
	}
}

// fetchProfile writes the proxy's /debug/pprof/<what> (--profiling) to path, asking until the
// metrics server answers (for up to 10 s), and sends the outcome.
func fetchProfile(ns *netns.NS, what, path string) <-chan error {
	done := make(chan error, 1)
	go func() {
		hc := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DialContext: ns.DialContext, DisableKeepAlives: true}}
		deadline := time.Now().Add(10 * time.Second)
		for {
			resp, err := hc.Get("http://" + scaleMetricsAddr + "/debug/pprof/" + what)
			if err != nil {
				if time.Now().Before(deadline) {
					time.Sleep(5 * time.Millisecond)
					continue
				}
				done <- err
				return
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err == nil && resp.StatusCode != http.StatusOK {
				err = fmt.Errorf("%s: %s: %.200s", what, resp.Status, b)
			}
			if err == nil {
				err = os.WriteFile(path, b, 0o644)
			}
			done <- err
			return
		}
	}()
	return done
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
