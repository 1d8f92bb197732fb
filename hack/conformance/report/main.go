// Command report turns the JUnit files of one run of Kubernetes' end-to-end suite (e2e.test
// under ginkgo, as hack/conformance.sh runs it) into the conformance report: it records the run
// under its proxy's name in docs/conformance.json, keeping the other proxies' runs, and writes
// docs/conformance.md from the whole JSON (a table spec → proxy, the counts of each run, the
// extra skips and the exceptions with their reasons).
//
//	go run ./hack/conformance/report -run kube-userspace-proxy -started 2026-01-02T15:04:05Z \
//	    -focus '\[sig-network\]' -skip '...' -skips hack/conformance/skips.txt \
//	    -exceptions hack/conformance/exceptions.txt -json docs/conformance.json \
//	    -md docs/conformance.md -trim docs/conformance/kube-userspace-proxy DIR/junit_*.xml
//
// Only specs whose full name matches the focus count. A spec is passed or failed if it ran in
// any of the files (the parallel and the serial invocation each write one), else skipped: left
// out by the skip expression or skipped by the spec itself (its reason is in the JUnit file).
// Failures of suite-level nodes ([SynchronizedBeforeSuite], ...) count as failures under their
// own names. With -trim, each JUnit file is also copied into that directory with the specs
// outside the focus left out (the suite lists every spec it has, some 7,000).
// -check exits 1 when the run failed a spec, after writing the report.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"time"
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "report:", err)
		os.Exit(1)
	}
}

func run(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("report", flag.ContinueOnError)
	var (
		name       = fs.String("run", "", "the run's name: "+fmt.Sprint(runNames))
		started    = fs.String("started", "", "when the run started (RFC 3339)")
		kubernetes = fs.String("kubernetes", "v1.36.3", "the Kubernetes version of e2e.test")
		focus      = fs.String("focus", "", "the run's ginkgo focus (a regular expression)")
		skip       = fs.String("skip", "", "the run's ginkgo skip (a regular expression)")
		skips      = fs.String("skips", "", "the file of extra skips: EXPRESSION<TAB>REASON lines")
		exceptions = fs.String("exceptions", "", "the file of exceptions: SPEC<TAB>REASON lines")
		jsonPath   = fs.String("json", "", "the JSON report to update")
		mdPath     = fs.String("md", "", "the Markdown report to write")
		trim       = fs.String("trim", "", "a directory to copy the JUnit files into, trimmed to the focus")
		check      = fs.Bool("check", false, "exit 1 when the run failed a spec")
	)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *jsonPath == "" || *focus == "" {
		return fmt.Errorf("-json and -focus are required")
	}
	focusRE, err := regexp.Compile(*focus)
	if err != nil {
		return fmt.Errorf("-focus: %w", err)
	}
	if !validRun(*name) {
		return fmt.Errorf("-run %q: want one of %v", *name, runNames)
	}
	at, err := time.Parse(time.RFC3339, *started)
	if err != nil {
		return fmt.Errorf("-started: %w", err)
	}
	if fs.NArg() == 0 {
		return fmt.Errorf("no JUnit files given")
	}
	var suites []*junitFile
	for _, p := range fs.Args() {
		f, err := readJUnit(p)
		if err != nil {
			return err
		}
		suites = append(suites, f)
	}
	res := summarize(suites, focusRE)
	res.Started = at.UTC().Format(time.RFC3339)

	rep, err := loadReport(*jsonPath)
	if err != nil {
		return err
	}
	var extra []skipReason
	if *skips != "" {
		if extra, err = readPairs(*skips); err != nil {
			return err
		}
	}
	rep.Exceptions = map[string]string{}
	if *exceptions != "" {
		pairs, err := readPairs(*exceptions)
		if err != nil {
			return err
		}
		for _, p := range pairs {
			rep.Exceptions[p.What] = p.Reason
		}
	}
	dropped := rep.record(*name, *kubernetes, *focus, *skip, res)
	for _, d := range dropped {
		fmt.Fprintf(os.Stderr, "report: the %s run had another focus or skip; it is dropped from the report\n", d)
	}
	if err := writeFileAtomic(*jsonPath, rep.encode()); err != nil {
		return err
	}
	if *mdPath != "" {
		md := renderMarkdown(rep, extra, reasonsOf(suites, focusRE))
		if err := writeFileAtomic(*mdPath, []byte(md)); err != nil {
			return err
		}
	}
	if *trim != "" {
		if err := os.MkdirAll(*trim, 0o755); err != nil {
			return err
		}
		for _, f := range suites {
			data, err := f.trimmed(focusRE)
			if err != nil {
				return err
			}
			if err := writeFileAtomic(filepath.Join(*trim, filepath.Base(f.path)), data); err != nil {
				return err
			}
		}
	}
	fmt.Fprintf(stdout, "%s: %d ran, %d passed, %d failed, %d skipped\n", *name,
		len(res.Passed)+len(res.Failed), len(res.Passed), len(res.Failed), len(res.Skipped))
	for _, f := range res.Failed {
		fmt.Fprintf(stdout, "  FAILED %s\n", f)
	}
	if *check && len(res.Failed) > 0 {
		return fmt.Errorf("%d spec(s) failed", len(res.Failed))
	}
	return nil
}

// writeFileAtomic writes data to a temporary file beside path and renames it into place.
func writeFileAtomic(path string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
