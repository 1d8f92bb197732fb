package main

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// testdata/junit_parallel_01.xml is a real JUnit file of e2e.test under ginkgo (the parallel
// invocation of hack/conformance.sh against the local cluster), cut down to a few test cases
// of each kind: a spec in focus that passed, one that failed, one the run left out; a spec
// outside the focus; the suite-level nodes.
const sample = "testdata/junit_parallel_01.xml"

const (
	sampleFocus = `\[sig-network\]`
	samplePass  = "[sig-network] Services should be able to change the type from ClusterIP to ExternalName [Conformance]"
	sampleFail  = "[sig-network] Proxy version v1 A set of valid responses are returned for both pod and service Proxy [Conformance]"
	// left out by the run's focus (the [Conformance] specs)
	sampleSkipped = "[sig-network] Services should be rejected for evicted pods (no endpoints exist)"
	sampleOther   = "[sig-apps] ControllerRevision [Serial] should manage the lifecycle of a ControllerRevision [Conformance]"
)

func TestSummarizeRealJUnit(t *testing.T) {
	f, err := readJUnit(sample)
	if err != nil {
		t.Fatal(err)
	}
	res := summarize([]*junitFile{f}, regexp.MustCompile(sampleFocus))
	if !slices.Contains(res.Passed, samplePass) {
		t.Errorf("passed %q does not list %q", res.Passed, samplePass)
	}
	if !slices.Contains(res.Failed, sampleFail) {
		t.Errorf("failed %q does not list %q", res.Failed, sampleFail)
	}
	if !slices.Contains(res.Skipped, sampleSkipped) {
		t.Errorf("skipped %q does not list %q", res.Skipped, sampleSkipped)
	}
	for _, list := range [][]string{res.Passed, res.Failed, res.Skipped} {
		for _, s := range list {
			if strings.HasPrefix(s, "[It]") || s == sampleOther {
				t.Errorf("the summary lists %q: want specs in focus, by their full name", s)
			}
		}
	}
	reasons := reasonsOf([]*junitFile{f}, regexp.MustCompile(sampleFocus))
	if r, ok := reasons[sampleSkipped]; ok {
		t.Errorf("a reason %q for %q, which the skip expression left out", r, sampleSkipped)
	}
}

func TestMergeParallelAndSerial(t *testing.T) {
	focus := regexp.MustCompile(sampleFocus)
	spec := func(name, status string) junitTestCase {
		c := junitTestCase{Name: specPrefix + name, Status: status}
		if status == "skipped" {
			c.Skipped = &junitMessage{Message: "skipped"}
		}
		return c
	}
	par := &junitFile{junitSuites: junitSuites{Suites: []junitSuite{{Cases: []junitTestCase{
		spec("[sig-network] a", "passed"), spec("[sig-network] b [Serial]", "skipped"), spec("[sig-network] c", "skipped"),
	}}}}}
	ser := &junitFile{junitSuites: junitSuites{Suites: []junitSuite{{Cases: []junitTestCase{
		spec("[sig-network] a", "skipped"), spec("[sig-network] b [Serial]", "failed"), spec("[sig-network] c", "skipped"),
		{Name: "[SynchronizedBeforeSuite]", Status: "failed"}, {Name: "[ReportAfterSuite] x", Status: "passed"},
	}}}}}
	res := summarize([]*junitFile{par, ser}, focus)
	want := result{
		Passed:  []string{"[sig-network] a"},
		Failed:  []string{"[SynchronizedBeforeSuite]", "[sig-network] b [Serial]"},
		Skipped: []string{"[sig-network] c"},
	}
	if !slices.Equal(res.Passed, want.Passed) || !slices.Equal(res.Failed, want.Failed) || !slices.Equal(res.Skipped, want.Skipped) {
		t.Errorf("summarize = %+v, want %+v", res, want)
	}
}

func TestTrimmedKeepsTheFocus(t *testing.T) {
	f, err := readJUnit(sample)
	if err != nil {
		t.Fatal(err)
	}
	focus := regexp.MustCompile(sampleFocus)
	data, err := f.trimmed(focus)
	if err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(t.TempDir(), "junit.xml")
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		t.Fatal(err)
	}
	g, err := readJUnit(tmp)
	if err != nil {
		t.Fatalf("the trimmed file does not read back: %v", err)
	}
	before, after := summarize([]*junitFile{f}, focus), summarize([]*junitFile{g}, focus)
	if !slices.Equal(before.Passed, after.Passed) || !slices.Equal(before.Failed, after.Failed) || !slices.Equal(before.Skipped, after.Skipped) {
		t.Errorf("trimming changed the summary: %+v, then %+v", before, after)
	}
	if strings.Contains(string(data), sampleOther) {
		t.Errorf("the trimmed file still holds %q", sampleOther)
	}
	var failures int
	for _, s := range g.Suites {
		failures += s.Failures + s.Errors
		if s.Tests != len(s.Cases) {
			t.Errorf("suite %q: tests=%d for %d test cases", s.Name, s.Tests, len(s.Cases))
		}
	}
	if failures == 0 {
		t.Error("the trimmed file counts no failure")
	}
}

func TestRunWritesTheReport(t *testing.T) {
	dir := t.TempDir()
	jsonPath, mdPath := filepath.Join(dir, "conformance.json"), filepath.Join(dir, "conformance.md")
	exceptions := filepath.Join(dir, "exceptions.txt")
	if err := os.WriteFile(exceptions, []byte("# comment\n"+sampleFail+"\tthe reason\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	args := func(run string) []string {
		return []string{"-run", run, "-started", "2026-01-02T15:04:05+01:00", "-focus", sampleFocus,
			"-skip", "evicted pods", "-exceptions", exceptions, "-json", jsonPath, "-md", mdPath,
			"-trim", filepath.Join(dir, "junit", run), sample}
	}
	for _, run := range []string{"iptables", "kube-userspace-proxy"} {
		if err := run1(t, args(run)); err != nil {
			t.Fatalf("run %s: %v", run, err)
		}
	}
	if err := run1(t, append([]string{"-check"}, args("nftables")...)); err == nil {
		t.Error("-check passed a run with a failed spec")
	}
	data, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(data, &raw); err != nil {
		t.Fatal(err)
	}
	var keys []string
	for k := range raw {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	if want := []string{"exceptions", "focus", "kubernetes", "runs", "skip"}; !slices.Equal(keys, want) {
		t.Errorf("the JSON's keys are %q, want %q", keys, want)
	}
	rep, err := loadReport(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 3 || rep.Runs["iptables"].Started != "2026-01-02T14:04:05Z" {
		t.Errorf("runs = %v; want all three, started in UTC", rep.Runs)
	}
	if rep.Exceptions[sampleFail] != "the reason" {
		t.Errorf("exceptions = %v", rep.Exceptions)
	}
	md, err := os.ReadFile(mdPath)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| kube-proxy iptables |", samplePass, "**FAIL**", "the reason"} {
		if !strings.Contains(string(md), want) {
			t.Errorf("the Markdown report does not say %q", want)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "junit", "iptables", filepath.Base(sample))); err != nil {
		t.Errorf("no trimmed JUnit file: %v", err)
	}

	// Another focus replaces the runs of the old one.
	if err := run1(t, []string{"-run", "iptables", "-started", "2026-01-03T00:00:00Z", "-focus", `Services`,
		"-json", jsonPath, sample}); err != nil {
		t.Fatal(err)
	}
	if rep, err = loadReport(jsonPath); err != nil {
		t.Fatal(err)
	}
	if len(rep.Runs) != 1 || rep.Focus != "Services" {
		t.Errorf("after a run of another focus: focus %q, runs %v; want that run alone", rep.Focus, rep.Runs)
	}
}

func TestBadInput(t *testing.T) {
	dir := t.TempDir()
	notJUnit := filepath.Join(dir, "x.xml")
	if err := os.WriteFile(notJUnit, []byte("<html/>"), 0o644); err != nil {
		t.Fatal(err)
	}
	badPairs := filepath.Join(dir, "pairs.txt")
	if err := os.WriteFile(badPairs, []byte("no tab here\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	base := []string{"-started", "2026-01-02T15:04:05Z", "-focus", "x", "-json", filepath.Join(dir, "r.json")}
	for name, tc := range map[string]struct {
		args []string
		want string
	}{
		"unknown run": {append([]string{"-run", "ipvs"}, append(base, sample)...), "-run"},
		"bad time":    {[]string{"-run", "iptables", "-started", "yesterday", "-focus", "x", "-json", "r.json", sample}, "-started"},
		"bad focus":   {[]string{"-run", "iptables", "-started", "2026-01-02T15:04:05Z", "-focus", "(", "-json", "r.json", sample}, "-focus"},
		"no files":    {append([]string{"-run", "iptables"}, base...), "no JUnit"},
		"not junit":   {append([]string{"-run", "iptables"}, append(base, notJUnit)...), notJUnit},
		"bad pairs":   {append([]string{"-run", "iptables", "-exceptions", badPairs}, append(base, sample)...), "pairs.txt:1"},
	} {
		err := run1(t, tc.args)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one naming %q", name, err, tc.want)
		}
	}
}

// run1 runs the command with args, its output discarded.
func run1(t *testing.T, args []string) error {
	t.Helper()
	return run(args, io.Discard)
}
