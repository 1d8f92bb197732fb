package main

import (
	"encoding/xml"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"
)

// The JUnit format as ginkgo's reporters write it (github.com/onsi/ginkgo/v2/reporters): the
// fields this command reads, and all it needs to write a trimmed copy back.
type junitSuites struct {
	XMLName  xml.Name     `xml:"testsuites"`
	Tests    int          `xml:"tests,attr"`
	Disabled int          `xml:"disabled,attr"`
	Errors   int          `xml:"errors,attr"`
	Failures int          `xml:"failures,attr"`
	Time     float64      `xml:"time,attr"`
	Suites   []junitSuite `xml:"testsuite"`
}

type junitSuite struct {
	Name       string          `xml:"name,attr"`
	Package    string          `xml:"package,attr"`
	Tests      int             `xml:"tests,attr"`
	Disabled   int             `xml:"disabled,attr"`
	Skipped    int             `xml:"skipped,attr"`
	Errors     int             `xml:"errors,attr"`
	Failures   int             `xml:"failures,attr"`
	Time       float64         `xml:"time,attr"`
	Timestamp  string          `xml:"timestamp,attr"`
	Properties *junitInnerXML  `xml:"properties,omitempty"`
	Cases      []junitTestCase `xml:"testcase"`
}

type junitInnerXML struct {
	Inner string `xml:",innerxml"`
}

type junitTestCase struct {
	Name      string        `xml:"name,attr"`
	Classname string        `xml:"classname,attr"`
	Status    string        `xml:"status,attr"`
	Time      float64       `xml:"time,attr"`
	Owner     string        `xml:"owner,attr,omitempty"`
	Skipped   *junitMessage `xml:"skipped,omitempty"`
	Error     *junitMessage `xml:"error,omitempty"`
	Failure   *junitMessage `xml:"failure,omitempty"`
	SystemOut string        `xml:"system-out,omitempty"`
	SystemErr string        `xml:"system-err,omitempty"`
}

type junitMessage struct {
	Message     string `xml:"message,attr"`
	Type        string `xml:"type,attr,omitempty"`
	Description string `xml:",chardata"`
}

// junitFile is one JUnit file and where it came from.
type junitFile struct {
	path string
	junitSuites
}

func readJUnit(path string) (*junitFile, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	f := &junitFile{path: path}
	if err := xml.Unmarshal(data, &f.junitSuites); err != nil {
		return nil, fmt.Errorf("%s: not a JUnit file of testsuites: %w", path, err)
	}
	if len(f.Suites) == 0 {
		return nil, fmt.Errorf("%s: no testsuite", path)
	}
	return f, nil
}

// specPrefix starts the name of every spec's test case; suite-level nodes have other prefixes
// ([SynchronizedBeforeSuite], [ReportAfterSuite] ...).
const specPrefix = "[It] "

// outcome is a test case's result, ordered: a higher one wins when a spec appears more than once.
type outcome int

const (
	skipped outcome = iota
	passed
	failed
)

func (c junitTestCase) outcome() outcome {
	switch c.Status {
	case "passed":
		return passed
	case "skipped", "pending":
		return skipped
	}
	return failed // failed, timedout, panicked, interrupted, aborted
}

// skipReason is the reason a spec gave for skipping itself ("" when the run left it out).
func (c junitTestCase) skipReason() string {
	if c.Skipped == nil {
		return ""
	}
	r, ok := strings.CutPrefix(c.Skipped.Message, "skipped - ")
	if !ok {
		return ""
	}
	return strings.TrimSpace(r)
}

// result is one run's outcome: the names of the specs (full text, as focus and skip see them).
type result struct {
	Started string   `json:"started"`
	Passed  []string `json:"passed"`
	Failed  []string `json:"failed"`
	Skipped []string `json:"skipped"`
}

// summarize merges the files of one run: the specs whose name matches focus, each passed,
// failed or skipped; failed suite-level nodes count as failed under their own names.
func summarize(files []*junitFile, focus *regexp.Regexp) result {
	best := map[string]outcome{}
	for _, f := range files {
		for _, s := range f.Suites {
			for _, c := range s.Cases {
				name, isSpec := strings.CutPrefix(c.Name, specPrefix)
				o := c.outcome()
				if isSpec && !focus.MatchString(name) {
					continue
				}
				if !isSpec {
					if o != failed {
						continue
					}
					name = c.Name
				}
				if prev, ok := best[name]; !ok || o > prev {
					best[name] = o
				}
			}
		}
	}
	r := result{Passed: []string{}, Failed: []string{}, Skipped: []string{}}
	for name, o := range best {
		switch o {
		case passed:
			r.Passed = append(r.Passed, name)
		case failed:
			r.Failed = append(r.Failed, name)
		default:
			r.Skipped = append(r.Skipped, name)
		}
	}
	sort.Strings(r.Passed)
	sort.Strings(r.Failed)
	sort.Strings(r.Skipped)
	return r
}

// reasonsOf returns, for the specs in focus that skipped themselves, the reason they gave.
func reasonsOf(files []*junitFile, focus *regexp.Regexp) map[string]string {
	out := map[string]string{}
	for _, f := range files {
		for _, s := range f.Suites {
			for _, c := range s.Cases {
				name, isSpec := strings.CutPrefix(c.Name, specPrefix)
				if !isSpec || !focus.MatchString(name) {
					continue
				}
				if r := c.skipReason(); r != "" {
					out[name] = r
				}
			}
		}
	}
	return out
}

// trimmed returns the file with only the suite-level nodes and the specs in focus, its counts
// made to agree.
func (f *junitFile) trimmed(focus *regexp.Regexp) ([]byte, error) {
	out := junitSuites{Time: f.Time}
	for _, s := range f.Suites {
		t := s
		t.Cases = nil
		t.Tests, t.Disabled, t.Skipped, t.Errors, t.Failures = 0, 0, 0, 0, 0
		for _, c := range s.Cases {
			if name, isSpec := strings.CutPrefix(c.Name, specPrefix); isSpec && !focus.MatchString(name) {
				continue
			}
			t.Cases = append(t.Cases, c)
			t.Tests++
			switch {
			case c.Status == "pending":
				t.Disabled++
			case c.Skipped != nil:
				t.Skipped++
			case c.Error != nil:
				t.Errors++
			case c.Failure != nil:
				t.Failures++
			}
		}
		out.Suites = append(out.Suites, t)
		out.Tests += t.Tests
		out.Disabled += t.Disabled
		out.Errors += t.Errors
		out.Failures += t.Failures
	}
	data, err := xml.MarshalIndent(out, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("%s: %w", f.path, err)
	}
	return append([]byte(xml.Header), append(data, '\n')...), nil
}
