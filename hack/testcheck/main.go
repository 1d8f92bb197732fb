// Command testcheck reads `go test -json` on stdin, prints what plain `go test` would (a line per
// package; the output of failed tests in full), and exits non-zero when a test or a package
// failed, when one was skipped, or when no package reported at all. `make test` pipes the whole
// suite through it under KUP_TEST_ALL=1, where nothing may skip: a skipped test is a tier CI
// did not run.
//
//	KUP_TEST_ALL=1 go test -json ./... 2>&1 | go run ./hack/testcheck
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
)

// event is one line of `go test -json` (cmd/test2json).
type event struct {
	Action     string
	Package    string
	Test       string
	Output     string
	ImportPath string // build-output events
}

func main() {
	os.Exit(run(os.Stdin, os.Stdout))
}

type key struct{ pkg, test string }

func run(in io.Reader, out io.Writer) int {
	var (
		output   = map[key][]string{} // buffered output per test and per package ("" test)
		failed   []string
		skipped  []string
		packages int
	)
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		line := sc.Bytes()
		var e event
		if len(line) == 0 || line[0] != '{' || json.Unmarshal(line, &e) != nil {
			fmt.Fprintf(out, "%s\n", line) // the go command's own messages
			continue
		}
		k := key{e.Package, e.Test}
		switch e.Action {
		case "build-output":
			fmt.Fprint(out, e.Output)
		case "output":
			output[k] = append(output[k], e.Output)
			if e.Test == "" && strings.HasPrefix(e.Output, "SKIP:") { // testenv.Main: a package's every test
				skipped = append(skipped, e.Package+": "+strings.TrimSpace(strings.TrimPrefix(e.Output, "SKIP:")))
			}
		case "skip":
			if e.Test == "" {
				packages++ // no test files
				printSummary(out, output[k])
			} else {
				skipped = append(skipped, e.Package+" "+e.Test+": "+skipReason(output[k]))
			}
			delete(output, k)
		case "pass":
			if e.Test == "" {
				packages++
				printSummary(out, output[k])
			}
			delete(output, k)
		case "fail":
			if e.Test != "" {
				failed = append(failed, e.Package+" "+e.Test)
				fmt.Fprint(out, strings.Join(output[k], ""))
			} else {
				packages++
				failed = append(failed, e.Package)
				fmt.Fprint(out, strings.Join(output[k], ""))
			}
			delete(output, k)
		}
	}
	if err := sc.Err(); err != nil {
		fmt.Fprintf(out, "testcheck: reading go test -json: %v\n", err)
		return 1
	}
	code := 0
	if packages == 0 {
		fmt.Fprintln(out, "testcheck: no package reported a result")
		code = 1
	}
	if len(failed) > 0 {
		fmt.Fprintf(out, "\ntestcheck: %d failed:\n  %s\n", len(failed), strings.Join(failed, "\n  "))
		code = 1
	}
	if len(skipped) > 0 {
		sort.Strings(skipped)
		fmt.Fprintf(out, "\ntestcheck: %d skipped; every tier must run here (KUP_TEST_ALL=1):\n  %s\n", len(skipped), strings.Join(skipped, "\n  "))
		code = 1
	}
	return code
}

// printSummary prints a package's closing line ("ok  pkg 1.2s", "?   pkg [no test files]") from
// its package-level output.
func printSummary(out io.Writer, lines []string) {
	for _, l := range lines {
		if strings.HasPrefix(l, "ok ") || strings.HasPrefix(l, "?") || strings.HasPrefix(l, "SKIP:") {
			fmt.Fprint(out, l)
		}
	}
}

// skipReason returns the message of a skipped test: its output after the "--- SKIP" line.
func skipReason(lines []string) string {
	var msg []string
	after := false
	for _, l := range lines {
		t := strings.TrimSpace(l)
		if strings.HasPrefix(t, "--- SKIP") {
			after = true
			continue
		}
		if after && t != "" {
			msg = append(msg, t)
		}
	}
	if len(msg) == 0 {
		return "(no message)"
	}
	return strings.Join(msg, " ")
}
