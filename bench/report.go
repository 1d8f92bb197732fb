// Package bench is the benchmark of kube-userspace-proxy against upstream kube-proxy's iptables
// mode, HAProxy and direct pod access (see bench/README.md and docs/performance.md). The measurement itself is
// bench_test.go, behind the "bench" build tag (`make bench`); this file holds the report: the
// samples, their medians, and the markdown, JSON and SVG outputs under bench/results/.
package bench

import (
	"encoding/json"
	"fmt"
	"html"
	"io"
	"math"
	"slices"
	"strings"
	"sync"
	"time"
)

// Path names, in the order of the table's columns. Baseline is the path ratios are taken to.
const (
	PathDirect   = "direct"
	PathIPTables = "iptables"
	PathKUP      = "kube-userspace-proxy"
	PathHAProxy  = "haproxy"
	// PathHAProxyRedirect is the same HAProxy reached through the ClusterIP, behind a copy of
	// kube-userspace-proxy's node rules: what userspace mode's netfilter work costs any proxy.
	PathHAProxyRedirect = "haproxy redirect"
	Baseline            = PathIPTables
)

// Paths are the measured paths in table order. PathKUP is kube-userspace-proxy as it starts by
// default; the targets are checked against it.
var Paths = []string{PathDirect, PathIPTables, PathKUP, PathHAProxy, PathHAProxyRedirect}

// Paths of the outside-client table: an outside client to the NodePort of an
// externalTrafficPolicy: Local service whose endpoint is on the receiving node, through
// kube-userspace-proxy with --transparent-local=true (PathTransparent) and =false (PathPlain),
// and through iptables mode (PathIPTables, the baseline).
const (
	PathTransparent = "userspace transparent"
	PathPlain       = "userspace plain"
)

// OutsidePaths are the paths of the outside-client table in column order.
var OutsidePaths = []string{PathIPTables, PathTransparent, PathPlain}

// Metric is one figure measured on every path: several samples per path, or a note saying why a
// path has none.
type Metric struct {
	// Workload names what was measured ("bulk TCP, 1 stream"); Source is where the client ran
	// ("pod", "node", or empty when it does not apply).
	Workload string `json:"workload"`
	Source   string `json:"source,omitempty"`
	// Unit of the samples; HigherBetter says which way is good.
	Unit         string `json:"unit"`
	HigherBetter bool   `json:"higher_better"`
	// Samples per path, one per repetition.
	Samples map[string][]float64 `json:"samples"`
	// Notes per path: why it has no (or partial) samples.
	Notes map[string]string `json:"notes,omitempty"`

	mu sync.Mutex // Add and Note may be called from several goroutines (paths measured at once)
}

// Add records one sample for path.
func (m *Metric) Add(path string, v float64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.Samples == nil {
		m.Samples = map[string][]float64{}
	}
	m.Samples[path] = append(m.Samples[path], v)
}

// Note records why path lacks samples (the last note wins).
func (m *Metric) Note(path, note string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.Notes == nil {
		m.Notes = map[string]string{}
	}
	m.Notes[path] = note
}

// Summary is the median, min and max of a path's samples; N is 0 when there are none.
type Summary struct {
	N                int     `json:"n"`
	Median, Min, Max float64 `json:"-"`
}

// MarshalJSON writes the summary with null for missing values.
func (s Summary) MarshalJSON() ([]byte, error) {
	if s.N == 0 {
		return []byte(`{"n":0}`), nil
	}
	return json.Marshal(map[string]any{"n": s.N, "median": s.Median, "min": s.Min, "max": s.Max})
}

// Summarize returns the summary of path's samples.
func (m *Metric) Summarize(path string) Summary {
	v := slices.Clone(m.Samples[path])
	if len(v) == 0 {
		return Summary{}
	}
	slices.Sort(v)
	med := v[len(v)/2]
	if len(v)%2 == 0 {
		med = (v[len(v)/2-1] + v[len(v)/2]) / 2
	}
	return Summary{N: len(v), Median: med, Min: v[0], Max: v[len(v)-1]}
}

// Ratio returns path's median over the baseline's median, and false if either is missing.
func (m *Metric) Ratio(path string) (float64, bool) {
	return m.RatioTo(path, Baseline)
}

// RatioTo returns path's median over base's median, and false if either is missing.
func (m *Metric) RatioTo(path, base string) (float64, bool) {
	s, b := m.Summarize(path), m.Summarize(base)
	if s.N == 0 || b.N == 0 || b.Median == 0 {
		return 0, false
	}
	return s.Median / b.Median, true
}

// Report is one run of the benchmark.
type Report struct {
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	Quick    bool      `json:"quick"`
	Reps     int       `json:"repetitions"`
	// LoadStart and LoadEnd are /proc/loadavg at the start and the end.
	LoadStart string `json:"loadavg_start"`
	LoadEnd   string `json:"loadavg_end"`
	// Machine describes the machine (CPUs, kernel, versions).
	Machine string `json:"machine"`
	// Notes are remarks printed under the table.
	Notes   []string  `json:"notes,omitempty"`
	Metrics []*Metric `json:"metrics"`
	// Outside are the outside-client metrics (paths OutsidePaths), a table of their own.
	Outside []*Metric `json:"outside_metrics,omitempty"`
	// OutsideNotes are remarks printed under the outside-client table.
	OutsideNotes []string `json:"outside_notes,omitempty"`
}

// OutsideMetric returns the outside-client metric workload, creating it with unit and direction.
func (r *Report) OutsideMetric(workload, unit string, higherBetter bool) *Metric {
	for _, m := range r.Outside {
		if m.Workload == workload {
			return m
		}
	}
	m := &Metric{Workload: workload, Source: "outside client", Unit: unit, HigherBetter: higherBetter}
	r.Outside = append(r.Outside, m)
	return m
}

// Metric returns the metric (workload, source), creating it with unit and direction.
func (r *Report) Metric(workload, source, unit string, higherBetter bool) *Metric {
	for _, m := range r.Metrics {
		if m.Workload == workload && m.Source == source {
			return m
		}
	}
	m := &Metric{Workload: workload, Source: source, Unit: unit, HigherBetter: higherBetter}
	r.Metrics = append(r.Metrics, m)
	return m
}

// jsonMetric is a Metric with its summaries and ratios, as written to the JSON file.
type jsonMetric struct {
	*Metric
	Summary map[string]Summary  `json:"summary"`
	Ratio   map[string]*float64 `json:"ratio_to_iptables"`
	// TransparentOverPlain is set on outside-client metrics: PathTransparent's median over
	// PathPlain's.
	TransparentOverPlain *float64 `json:"transparent_over_plain,omitempty"`
}

func summarizeJSON(m *Metric, paths []string) jsonMetric {
	jm := jsonMetric{Metric: m, Summary: map[string]Summary{}, Ratio: map[string]*float64{}}
	for _, p := range paths {
		jm.Summary[p] = m.Summarize(p)
		if q, ok := m.Ratio(p); ok {
			jm.Ratio[p] = &q
		} else {
			jm.Ratio[p] = nil
		}
	}
	return jm
}

// WriteJSON writes the report with every metric's summaries and ratios.
func (r *Report) WriteJSON(w io.Writer) error {
	out := struct {
		*Report
		Metrics []jsonMetric `json:"metrics"`
		Outside []jsonMetric `json:"outside_metrics,omitempty"`
	}{Report: r}
	for _, m := range r.Metrics {
		out.Metrics = append(out.Metrics, summarizeJSON(m, Paths))
	}
	for _, m := range r.Outside {
		jm := summarizeJSON(m, OutsidePaths)
		if q, ok := m.RatioTo(PathTransparent, PathPlain); ok {
			jm.TransparentOverPlain = &q
		}
		out.Outside = append(out.Outside, jm)
	}
	return encodeJSON(w, out, "JSON report")
}

// encodeJSON writes v to w as indented JSON; what names it in the error.
func encodeJSON(w io.Writer, v any, what string) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("write %s: %w", what, err)
	}
	return nil
}

// writeCells writes m's cell for each of paths, each followed by the column's closing " |".
func writeCells(b *strings.Builder, m *Metric, paths []string) {
	for _, p := range paths {
		b.WriteString(" " + cell(m, p) + " |")
	}
}

// writeNotes writes the notes under a "Notes:" heading, one bullet each; nothing for none.
func writeNotes(b *strings.Builder, notes []string) {
	if len(notes) == 0 {
		return
	}
	b.WriteString("\nNotes:\n\n")
	for _, n := range notes {
		b.WriteString("- " + n + "\n")
	}
}

// WriteMarkdown writes the table: one row per metric, one column per path, each cell
// "median [min–max] ×ratio-to-iptables".
func (r *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	mode := "full"
	if r.Quick {
		mode = "quick (BENCH_QUICK=1)"
	}
	fmt.Fprintf(&b, "# kube-userspace-proxy benchmark (%s run)\n\n", mode)
	fmt.Fprintf(&b, "Run %s → %s, %d repetitions per figure, paths interleaved per repetition. "+
		"Each cell: median [min–max] and the ratio of the median to iptables mode's.\n\n",
		r.Started.UTC().Format(time.RFC3339), r.Finished.UTC().Format(time.RFC3339), r.Reps)
	fmt.Fprintf(&b, "Machine: %s. Load average (1/5/15 min) at start: %s; at end: %s.\n\n", r.Machine, r.LoadStart, r.LoadEnd)
	b.WriteString("| workload | from | unit | " + strings.Join(Paths, " | ") + " |\n")
	b.WriteString("|---|---|---|" + strings.Repeat("---|", len(Paths)) + "\n")
	for _, m := range r.Metrics {
		fmt.Fprintf(&b, "| %s | %s | %s (%s) |", m.Workload, m.Source, m.Unit, m.direction())
		writeCells(&b, m, Paths)
		b.WriteString("\n")
	}
	writeNotes(&b, r.Notes)
	r.writeOutside(&b)
	_, err := io.WriteString(w, b.String())
	if err != nil {
		return fmt.Errorf("write markdown report: %w", err)
	}
	return nil
}

// direction says which way the metric is better, for the tables.
func (m *Metric) direction() string {
	if m.HigherBetter {
		return "↑ better"
	}
	return "↓ better"
}

// writeOutside writes the outside-client table: one column per OutsidePaths entry
// (cells as in the main table, ratios to iptables mode) and the transparent/plain ratio.
func (r *Report) writeOutside(b *strings.Builder) {
	if len(r.Outside) == 0 {
		return
	}
	b.WriteString("\n## From an outside client to a Local NodePort, endpoint on the receiving node\n\n")
	b.WriteString("| workload | unit | " + strings.Join(OutsidePaths, " | ") + " | transparent / plain |\n")
	b.WriteString("|---|---|" + strings.Repeat("---|", len(OutsidePaths)) + "---|\n")
	for _, m := range r.Outside {
		fmt.Fprintf(b, "| %s | %s (%s) |", m.Workload, m.Unit, m.direction())
		writeCells(b, m, OutsidePaths)
		if q, ok := m.RatioTo(PathTransparent, PathPlain); ok {
			fmt.Fprintf(b, " ×%.2f |\n", q)
		} else {
			b.WriteString(" – |\n")
		}
	}
	if len(r.OutsideNotes) > 0 {
		b.WriteString("\nNotes:\n\n")
		for _, n := range r.OutsideNotes {
			b.WriteString("- " + n + "\n")
		}
	}
}

func cell(m *Metric, p string) string {
	s := m.Summarize(p)
	note := m.Notes[p]
	if s.N == 0 {
		if note == "" {
			return "–"
		}
		return note
	}
	c := fmt.Sprintf("%s [%s–%s]", num(s.Median), num(s.Min), num(s.Max))
	if q, ok := m.Ratio(p); ok {
		c += fmt.Sprintf(" ×%.2f", q)
	}
	if note != "" {
		c += " (" + note + ")"
	}
	return c
}

// num formats v with three significant digits (no exponent for the usual ranges).
func num(v float64) string {
	a := math.Abs(v)
	switch {
	case a == 0:
		return "0"
	case a >= 1000:
		return fmt.Sprintf("%.0f", v)
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	case a >= 1:
		return fmt.Sprintf("%.2f", v)
	default:
		return fmt.Sprintf("%.3g", v)
	}
}

// pathColors are the bar colours of the plot, per path.
var pathColors = map[string]string{PathDirect: "#7f7f7f", PathIPTables: "#1f77b4", PathKUP: "#2ca02c", PathHAProxy: "#d62728", PathHAProxyRedirect: "#ff9896"}

// WriteSVG writes a plot of every metric as ratios to iptables mode: one group of horizontal
// bars per metric (one bar per path, the median; a whisker from min to max), with a line at 1.
// Ratios are capped at 4 so one outlier does not squash the rest; a capped bar says so.
func (r *Report) WriteSVG(w io.Writer) error {
	const (
		left, right, top = 330.0, 60.0, 50.0
		barH, gap        = 7.0, 8.0
		width            = 1000.0
		maxRatio         = 4.0
	)
	plotW := width - left - right
	x := func(q float64) float64 { return left + plotW*math.Min(q, maxRatio)/maxRatio }
	groupH := barH*float64(len(Paths)) + gap
	height := top + groupH*float64(len(r.Metrics)) + 40
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="10">`+"\n", width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="10" y="18" font-size="13">Ratio to iptables mode (median, whisker min–max; ↑/↓ = higher/lower is better)</text>`+"\n")
	for i, p := range Paths {
		fmt.Fprintf(&b, `<rect x="%.0f" y="28" width="10" height="10" fill="%s"/><text x="%.0f" y="37">%s</text>`+"\n", 10+float64(i)*160, pathColors[p], 24+float64(i)*160, html.EscapeString(p))
	}
	for q := 0.0; q <= maxRatio; q += 0.5 {
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.0f" y2="%.0f" stroke="%s"/>`+"\n", x(q), x(q), top, height-30, map[bool]string{true: "black", false: "#ddd"}[q == 1])
		fmt.Fprintf(&b, `<text x="%.1f" y="%.0f" text-anchor="middle">%.1f×</text>`+"\n", x(q), height-18, q)
	}
	for i, m := range r.Metrics {
		y0 := top + groupH*float64(i)
		arrow := "↓"
		if m.HigherBetter {
			arrow = "↑"
		}
		label := m.Workload
		if m.Source != "" {
			label += " (" + m.Source + ")"
		}
		fmt.Fprintf(&b, `<text x="%.0f" y="%.1f" text-anchor="end">%s %s</text>`+"\n", left-6, y0+groupH/2, html.EscapeString(label), arrow)
		base := m.Summarize(Baseline)
		for j, p := range Paths {
			s := m.Summarize(p)
			if s.N == 0 || base.N == 0 || base.Median == 0 {
				continue
			}
			y := y0 + barH*float64(j)
			q := s.Median / base.Median
			fmt.Fprintf(&b, `<rect x="%.0f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s %s: %s %s (×%.2f)</title></rect>`+"\n",
				left, y, x(q)-left, barH-1, pathColors[p], html.EscapeString(label), p, num(s.Median), html.EscapeString(m.Unit), q)
			fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="black"/>`+"\n", x(s.Min/base.Median), x(s.Max/base.Median), y+barH/2-0.5, y+barH/2-0.5)
			if q > maxRatio {
				fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" font-size="8">%.1f×</text>`+"\n", x(maxRatio)+3, y+barH-1, q)
			}
		}
	}
	b.WriteString("</svg>\n")
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("write SVG plot: %w", err)
	}
	return nil
}

// AddDifference adds the metric "<name>" holding, per path and repetition, the samples of
// metric m minus those of path base in the same repetition (e.g. the latency a proxy adds to
// the direct path). Paths whose sample count differs from base's (a failed run) get a note.
func (r *Report) AddDifference(m *Metric, name, base string) *Metric {
	d := r.Metric(name, m.Source, m.Unit, m.HigherBetter)
	b := m.Samples[base]
	for _, p := range Paths {
		if p == base {
			d.Note(p, "n/a (reference)")
			continue
		}
		s := m.Samples[p]
		if len(s) == 0 {
			if n := m.Notes[p]; n != "" {
				d.Note(p, n)
			}
			continue
		}
		if len(s) != len(b) {
			d.Note(p, "n/a (failed repetitions)")
			continue
		}
		for i := range s {
			d.Add(p, s[i]-b[i])
		}
	}
	return d
}

// Target is one of the goals for kube-userspace-proxy, checked against a run.
type Target struct {
	// Goal describes the target; Metric names the workload it applies to (every source).
	Goal, Metric string
	// Check decides from the metric whether the target is met and says what was measured.
	Check func(m *Metric) (met bool, got string)
}

// ratioAtLeast is a target on the ratio of kube-userspace-proxy's median to iptables mode's.
func ratioAtLeast(min float64) func(m *Metric) (bool, string) {
	return func(m *Metric) (bool, string) {
		q, ok := m.Ratio(PathKUP)
		if !ok {
			return false, "no figure"
		}
		return q >= min, fmt.Sprintf("×%.2f", q)
	}
}

// medianAtMost is a target on kube-userspace-proxy's median.
func medianAtMost(max float64) func(m *Metric) (bool, string) {
	return func(m *Metric) (bool, string) {
		s := m.Summarize(PathKUP)
		if s.N == 0 {
			return false, "no figure"
		}
		return s.Median <= max, num(s.Median) + " " + m.Unit
	}
}

// aheadOfHAProxy: kube-userspace-proxy's median is better than HAProxy's.
func aheadOfHAProxy(m *Metric) (bool, string) {
	k, h := m.Summarize(PathKUP), m.Summarize(PathHAProxy)
	if k.N == 0 || h.N == 0 {
		return true, "n/a"
	}
	met := k.Median < h.Median
	if m.HigherBetter {
		met = k.Median > h.Median
	}
	return met, fmt.Sprintf("%s vs %s %s", num(k.Median), num(h.Median), m.Unit)
}

// Targets are the data-path goals, and the control-plane ones at maxScale services from the API
// server (the figures from a manifests directory are in results/scale.md). Metric is matched as
// a prefix of the workload name.
func Targets(maxScale int) []Target {
	return []Target{
		{Goal: "at 10,000 services: one more service ≤ 100 ms", Metric: fmt.Sprintf("one more service → first connection, %d services", maxScale), Check: medianAtMost(100)},
		{Goal: "at 10,000 services: first full sync ≤ 1 s", Metric: fmt.Sprintf("full sync after restart, %d services", maxScale), Check: medianAtMost(1000)},
		{Goal: "at 10,000 services: RSS ≤ 100 MB (95.4 MiB)", Metric: fmt.Sprintf("RSS after restart, %d services", maxScale), Check: medianAtMost(100e6 / (1 << 20))},
		{Goal: "at 10,000 services: idle CPU ≤ 0.2 % of a core", Metric: fmt.Sprintf("idle CPU, %d services", maxScale), Check: medianAtMost(0.2)},
		{Goal: "bulk TCP ≥ 0.9× iptables", Metric: "bulk TCP", Check: ratioAtLeast(0.9)},
		{Goal: "short connections ≥ 0.6× iptables", Metric: "short connections", Check: ratioAtLeast(0.6)},
		{Goal: "added p99 latency ≤ 100 µs (vs direct)", Metric: "keep-alive latency p99 added", Check: medianAtMost(100)},
		{Goal: "UDP request/response ≥ 0.5× iptables", Metric: "UDP 64-byte req/resp", Check: ratioAtLeast(0.5)},
		{Goal: "≤ 10 KiB proxy memory per idle connection", Metric: "10000 idle connections: memory", Check: medianAtMost(10)},
		{Goal: fmt.Sprintf("one more service programmed ≤ 1 s at %d services", maxScale), Metric: fmt.Sprintf("one more service → first connection, %d services", maxScale), Check: medianAtMost(1000)},
		{Goal: "ahead of HAProxy", Metric: "", Check: aheadOfHAProxy},
	}
}

// WriteTargets writes one line per target and metric it applies to: met or not, and the figure.
func (r *Report) WriteTargets(w io.Writer, targets []Target) error {
	var b strings.Builder
	b.WriteString("\n## Targets (kube-userspace-proxy, medians of this run)\n\n| target | workload | from | measured | met |\n|---|---|---|---|---|\n")
	for _, tg := range targets {
		for _, m := range r.Metrics {
			if !strings.HasPrefix(m.Workload, tg.Metric) || m.Summarize(PathKUP).N == 0 {
				continue
			}
			if tg.Metric == "" && (m.Summarize(PathHAProxy).N == 0 || strings.Contains(m.Workload, "connections reached")) {
				continue
			}
			met, got := tg.Check(m)
			mark := "no"
			if met {
				mark = "yes"
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", tg.Goal, m.Workload, m.Source, got, mark)
		}
	}
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("write targets: %w", err)
	}
	return nil
}
