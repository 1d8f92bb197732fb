package bench

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

func TestSummarizeAndRatio(t *testing.T) {
	cases := []struct {
		name             string
		samples          []float64
		base             []float64
		med, min, max, q float64
		hasRatio         bool
	}{
		{name: "odd count", samples: []float64{3, 1, 2}, base: []float64{4, 4, 4}, med: 2, min: 1, max: 3, q: 0.5, hasRatio: true},
		{name: "even count", samples: []float64{4, 1, 3, 2}, base: []float64{5}, med: 2.5, min: 1, max: 4, q: 0.5, hasRatio: true},
		{name: "no baseline", samples: []float64{7}, med: 7, min: 7, max: 7},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := &Metric{}
			for _, v := range tc.samples {
				m.Add(PathKUP, v)
			}
			for _, v := range tc.base {
				m.Add(Baseline, v)
			}
			s := m.Summarize(PathKUP)
			if s.N != len(tc.samples) || s.Median != tc.med || s.Min != tc.min || s.Max != tc.max {
				t.Errorf("Summarize = %+v, want median %v min %v max %v", s, tc.med, tc.min, tc.max)
			}
			q, ok := m.Ratio(PathKUP)
			if ok != tc.hasRatio || q != tc.q {
				t.Errorf("Ratio = %v, %v; want %v, %v", q, ok, tc.q, tc.hasRatio)
			}
		})
	}
}

func TestReportOutputs(t *testing.T) {
	r := &Report{Reps: 2}
	lat := r.Metric("keep-alive latency p99", "pod", "µs", false)
	for _, p := range Paths {
		lat.Add(p, 100)
		lat.Add(p, 200)
	}
	lat.Samples[PathKUP] = []float64{150, 260}
	rss := r.Metric("RSS after restart, 100 services", "", "MiB", false)
	rss.Add(PathKUP, 96)
	rss.Add(PathKUP, 94)
	lat.Notes = map[string]string{PathHAProxy: "n/a (no UDP)"}
	added := r.AddDifference(lat, "keep-alive latency p99 added (vs direct)", PathDirect)
	if got := added.Summarize(PathKUP); got.Median != 55 || got.Min != 50 || got.Max != 60 {
		t.Errorf("added latency of kube-userspace-proxy = %+v, want median 55 [50–60]", got)
	}
	var md, js, svg bytes.Buffer
	if err := r.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	if err := r.WriteTargets(&md, Targets(100)); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| keep-alive latency p99 | pod | µs (↓ better) |", "205 [150–260] ×1.37", "added p99 latency ≤ 100 µs (vs direct) | keep-alive latency p99 added (vs direct) | pod | 55.0 µs | yes |",
		"| at 10,000 services: RSS ≤ 100 MB (95.4 MiB) | RSS after restart, 100 services |  | 95.0 MiB | yes |"} {
		if !strings.Contains(md.String(), want) {
			t.Errorf("markdown lacks %q:\n%s", want, md.String())
		}
	}
	if err := r.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var back map[string]any
	if err := json.Unmarshal(js.Bytes(), &back); err != nil {
		t.Errorf("JSON does not parse: %v", err)
	}
	if err := r.WriteSVG(&svg); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(svg.String(), "<svg") || strings.Count(svg.String(), "<rect") < 1+2*len(Paths) {
		t.Errorf("SVG lacks bars:\n%s", svg.String())
	}
}

func TestOutsideTable(t *testing.T) {
	cases := []struct {
		name    string
		samples map[string][]float64
		want    []string // in the markdown
		ratio   any      // transparent_over_plain in the JSON (nil: absent)
	}{
		{
			name:    "all paths",
			samples: map[string][]float64{PathIPTables: {10, 10}, PathTransparent: {6, 8}, PathPlain: {8, 8}},
			want:    []string{"| short connections | conn/s (↑ better) | 10.0 [10.0–10.0] ×1.00 | 7.00 [6.00–8.00] ×0.70 | 8.00 [8.00–8.00] ×0.80 | ×0.88 |"},
			ratio:   0.875,
		},
		{
			name:    "plain missing",
			samples: map[string][]float64{PathIPTables: {10}, PathTransparent: {5}},
			want:    []string{"| 5.00 [5.00–5.00] ×0.50 | – | – |"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := &Report{Reps: 2}
			m := r.OutsideMetric("short connections", "conn/s", true)
			if again := r.OutsideMetric("short connections", "conn/s", true); again != m || len(r.Outside) != 1 {
				t.Fatalf("OutsideMetric made a second metric of the same name")
			}
			for p, vs := range tc.samples {
				for _, v := range vs {
					m.Add(p, v)
				}
			}
			var md, js bytes.Buffer
			if err := r.WriteMarkdown(&md); err != nil {
				t.Fatal(err)
			}
			for _, want := range append(tc.want, "| workload | unit | iptables | userspace transparent | userspace plain | transparent / plain |") {
				if !strings.Contains(md.String(), want) {
					t.Errorf("markdown lacks %q:\n%s", want, md.String())
				}
			}
			if err := r.WriteJSON(&js); err != nil {
				t.Fatal(err)
			}
			var back struct {
				Outside []map[string]any `json:"outside_metrics"`
			}
			if err := json.Unmarshal(js.Bytes(), &back); err != nil || len(back.Outside) != 1 {
				t.Fatalf("JSON outside_metrics: %v, %d metrics", err, len(back.Outside))
			}
			if got := back.Outside[0]["transparent_over_plain"]; got != tc.ratio {
				t.Errorf("transparent_over_plain = %v, want %v", got, tc.ratio)
			}
		})
	}
}
