package bench

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"time"
)

// PathNFTables is upstream kube-proxy in nftables mode (the endpoint churn table only).
const PathNFTables = "nftables"

// ChurnPaths are the columns of the endpoint churn table, in order; ratios are to iptables mode.
var ChurnPaths = []string{PathIPTables, PathNFTables, PathKUP}

// ChurnReport is one run of the endpoint churn workload: its own table, since its paths are
// not the data-path table's.
type ChurnReport struct {
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	Quick    bool      `json:"quick"`
	// LoadStart and LoadEnd are /proc/loadavg at the start and the end.
	LoadStart string    `json:"loadavg_start"`
	LoadEnd   string    `json:"loadavg_end"`
	Machine   string    `json:"machine"`
	Notes     []string  `json:"notes,omitempty"`
	Metrics   []*Metric `json:"metrics"`
}

// Metric returns the row workload (which begins with "endpoint churn: "), creating it.
func (r *ChurnReport) Metric(workload, unit string, higherBetter bool) *Metric {
	workload = "endpoint churn: " + workload
	for _, m := range r.Metrics {
		if m.Workload == workload {
			return m
		}
	}
	m := &Metric{Workload: workload, Unit: unit, HigherBetter: higherBetter}
	r.Metrics = append(r.Metrics, m)
	return m
}

// WriteMarkdown writes the table: one row per metric, one column per ChurnPaths entry, each
// cell "median [min–max] ×ratio-to-iptables".
func (r *ChurnReport) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	mode := "full"
	if r.Quick {
		mode = "quick (BENCH_QUICK=1)"
	}
	fmt.Fprintf(&b, "# Endpoint churn (%s run)\n\n", mode)
	fmt.Fprintf(&b, "Run %s → %s. Machine: %s. Load average (1/5/15 min) at start: %s; at end: %s.\n\n",
		r.Started.UTC().Format(time.RFC3339), r.Finished.UTC().Format(time.RFC3339), r.Machine, r.LoadStart, r.LoadEnd)
	b.WriteString("| workload | unit | " + strings.Join(ChurnPaths, " | ") + " |\n")
	b.WriteString("|---|---|" + strings.Repeat("---|", len(ChurnPaths)) + "\n")
	for _, m := range r.Metrics {
		fmt.Fprintf(&b, "| %s | %s (%s) |", m.Workload, m.Unit, m.direction())
		writeCells(&b, m, ChurnPaths)
		b.WriteString("\n")
	}
	writeNotes(&b, r.Notes)
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("write churn markdown: %w", err)
	}
	return nil
}

// WriteJSON writes the report with every row's summaries and ratios.
func (r *ChurnReport) WriteJSON(w io.Writer) error {
	out := struct {
		*ChurnReport
		Metrics []jsonMetric `json:"metrics"`
	}{ChurnReport: r}
	for _, m := range r.Metrics {
		out.Metrics = append(out.Metrics, summarizeJSON(m, ChurnPaths))
	}
	return encodeJSON(w, out, "churn JSON")
}

// percentile returns the p-th percentile (0–100, nearest rank) of v; 0 for none.
func percentile(v []float64, p float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	i := int(float64(len(s))*p/100+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}
