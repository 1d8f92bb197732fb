//go:build cluster

package kcluster

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// The cluster's Prometheus (hack/cluster.sh monitoring), as the tests query it: through the
// forwarder on the machine's loopback that hack/cluster.sh prometheus-url names.

// scrapeInterval is the Prometheus configuration's (hack/cluster/monitoring/prometheus.yml).
const scrapeInterval = 10 * time.Second

// startMonitoring brings the cluster's Prometheus up (building it on first use, which takes
// minutes; cached after) or reloads its configuration, and returns its URL.
func startMonitoring(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	start := time.Now()
	if _, err := clusterSh(ctx, "monitoring"); err != nil {
		t.Fatal(err)
	}
	out, err := clusterSh(ctx, "prometheus-url")
	if err != nil {
		t.Fatal(err)
	}
	u := strings.TrimSpace(out)
	t.Logf("Prometheus at %s (hack/cluster.sh monitoring took %v)", u, time.Since(start).Round(time.Second))
	return u
}

// sample is one series of an instant query's answer.
type sample struct {
	labels map[string]string
	value  float64
}

func (s sample) String() string { return fmt.Sprintf("%v %g", s.labels, s.value) }

// promQuery runs an instant query.
func promQuery(base, query string) ([]sample, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/api/v1/query?query="+url.QueryEscape(query), nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("query %q: %w", query, err)
	}
	defer resp.Body.Close()
	var body struct {
		Status    string `json:"status"`
		ErrorType string `json:"errorType"`
		Error     string `json:"error"`
		Data      struct {
			ResultType string            `json:"resultType"`
			Result     []json.RawMessage `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("query %q: HTTP %d: %w", query, resp.StatusCode, err)
	}
	if body.Status != "success" {
		return nil, fmt.Errorf("query %q: %s: %s", query, body.ErrorType, body.Error)
	}
	if body.Data.ResultType != "vector" {
		return nil, fmt.Errorf("query %q: result type %s, want vector", query, body.Data.ResultType)
	}
	var out []sample
	for _, raw := range body.Data.Result {
		var r struct {
			Metric map[string]string `json:"metric"`
			Value  [2]any            `json:"value"`
		}
		if err := json.Unmarshal(raw, &r); err != nil {
			return nil, fmt.Errorf("query %q: %w", query, err)
		}
		s, _ := r.Value[1].(string)
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			return nil, fmt.Errorf("query %q: value %v: %w", query, r.Value[1], err)
		}
		out = append(out, sample{r.Metric, v})
	}
	return out, nil
}

// hasNumber reports whether some sample is a number (histogram_quantile over a window without
// observations gives NaN: a series, but no data to draw).
func hasNumber(s []sample) bool {
	for _, x := range s {
		if !math.IsNaN(x.value) && !math.IsInf(x.value, 0) {
			return true
		}
	}
	return false
}

// panelQuery is one query of a dashboard's panel.
type panelQuery struct {
	panel, legend, expr string
}

// dashboardQueries reads a Grafana dashboard's panels' queries (rows' panels included) and its
// query variables ("label_values(SELECTOR, LABEL)").
func dashboardQueries(t testing.TB, file string) (queries []panelQuery, variables map[string]string) {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	type panel struct {
		Title   string `json:"title"`
		Targets []struct {
			Expr         string `json:"expr"`
			LegendFormat string `json:"legendFormat"`
		} `json:"targets"`
		Panels []json.RawMessage `json:"panels"`
	}
	var d struct {
		Panels     []json.RawMessage `json:"panels"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Type  string `json:"type"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	var walk func([]json.RawMessage)
	walk = func(ps []json.RawMessage) {
		for _, raw := range ps {
			var p panel
			if err := json.Unmarshal(raw, &p); err != nil {
				t.Fatalf("%s: %v", file, err)
			}
			for _, tg := range p.Targets {
				queries = append(queries, panelQuery{p.Title, tg.LegendFormat, tg.Expr})
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	variables = map[string]string{}
	for _, v := range d.Templating.List {
		if q, ok := v.Query.(string); ok && v.Type == "query" {
			variables[v.Name] = q
		}
	}
	if len(queries) == 0 {
		t.Fatalf("%s: no panel queries", file)
	}
	return queries, variables
}

// rule is a Prometheus rule of a rule file.
type rule struct {
	Group       string            `json:"-"`
	Record      string            `json:"record"`
	Alert       string            `json:"alert"`
	Expr        string            `json:"expr"`
	For         string            `json:"for"`
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
}

func ruleFile(t testing.TB, file string) []rule {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Groups []struct {
			Name  string `json:"name"`
			Rules []rule `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.UnmarshalStrict(data, &f); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	var out []rule
	for _, g := range f.Groups {
		for _, r := range g.Rules {
			r.Group = g.Name
			r.Expr = strings.TrimSpace(r.Expr)
			out = append(out, r)
		}
	}
	if len(out) == 0 {
		t.Fatalf("%s: no rules", file)
	}
	return out
}

var (
	absentRe     = regexp.MustCompile(`(?s)^absent\((.*)\)$`)
	comparisonRe = regexp.MustCompile(`(?s)^(.*?)\s*(==|!=|>=|<=|>|<)\s*[-+0-9.eE]+$`)
)

// compared returns what an alert's expression compares with its threshold (or asks the
// absence of): the quantity that must have data for the alert to mean anything.
func compared(expr string) string {
	if m := absentRe.FindStringSubmatch(expr); m != nil {
		return strings.TrimSpace(m[1])
	}
	if m := comparisonRe.FindStringSubmatch(expr); m != nil {
		return strings.TrimSpace(m[1])
	}
	return expr
}

// monitoringFile is a file of deploy/monitoring.
func monitoringFile(name string) string {
	return filepath.Join(env.root, "deploy", "monitoring", name)
}
