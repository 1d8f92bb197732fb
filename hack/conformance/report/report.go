package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
)

// runNames are the runs the report holds, in the order of its table's columns: upstream
// kube-proxy in its two modes, then this project's proxy.
var runNames = []string{"iptables", "nftables", "kube-userspace-proxy"}

func validRun(name string) bool { return slices.Contains(runNames, name) }

// report is docs/conformance.json.
type report struct {
	Kubernetes string             `json:"kubernetes"`
	Focus      string             `json:"focus"`
	Skip       string             `json:"skip"`
	Runs       map[string]*result `json:"runs"`
	Exceptions map[string]string  `json:"exceptions"`
}

// loadReport reads the report at path; a missing file is an empty report.
func loadReport(path string) (*report, error) {
	r := &report{Runs: map[string]*result{}, Exceptions: map[string]string{}}
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return r, nil
	}
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(r); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if r.Runs == nil {
		r.Runs = map[string]*result{}
	}
	for name := range r.Runs {
		if !validRun(name) {
			return nil, fmt.Errorf("%s: runs.%s: not one of %v", path, name, runNames)
		}
	}
	return r, nil
}

// record puts res in as the run name. The report compares runs of one focus and skip: runs
// recorded under another pair are dropped, and their names returned.
func (r *report) record(name, kubernetes, focus, skip string, res result) (dropped []string) {
	if r.Focus != focus || r.Skip != skip || r.Kubernetes != kubernetes {
		for _, n := range runNames {
			if _, ok := r.Runs[n]; ok && n != name {
				dropped = append(dropped, n)
				delete(r.Runs, n)
			}
		}
	}
	r.Kubernetes, r.Focus, r.Skip = kubernetes, focus, skip
	r.Runs[name] = &res
	return dropped
}

func (r *report) encode() []byte {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	if err := enc.Encode(r); err != nil {
		panic(err) // maps of strings and slices of strings always encode
	}
	return buf.Bytes()
}

// skipReason is one line of a file of reasons: what (a skip expression or a spec's full name)
// and why.
type skipReason struct {
	What, Reason string
}

// readPairs reads WHAT<TAB>REASON lines; blank lines and lines starting with # are comments.
func readPairs(path string) ([]skipReason, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []skipReason
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if strings.TrimSpace(line) == "" || strings.HasPrefix(line, "#") {
			continue
		}
		what, why, ok := strings.Cut(line, "\t")
		what, why = strings.TrimSpace(what), strings.TrimSpace(why)
		if !ok || what == "" || why == "" {
			return nil, fmt.Errorf("%s:%d: want WHAT<TAB>REASON, got %q", path, n, line)
		}
		out = append(out, skipReason{What: what, Reason: why})
	}
	return out, sc.Err()
}
