package layout

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// historyRef matches a reference to development history by number: a work session or a work
// item ("issue") followed by its number, in any case, plural, possessive or hyphenated.
// The product's files speak of the product; its history is git log.
var historyRef = regexp.MustCompile(`(?i)\b(session|issue)s?[ #-]*[0-9]+`)

// upstreamNames are names from other projects that historyRef would match, removed from a line
// before it is checked: Kubernetes' end-to-end suite has an image (and a package) of this name.
// One letter is an escape, as in TestHistoryRefPattern.
var upstreamNames = []string{"regression-iss\x75e-74839"}

// historyRefIn returns the first history reference in line outside upstreamNames, or "".
func historyRefIn(line string) string {
	for _, n := range upstreamNames {
		line = strings.ReplaceAll(line, n, "")
	}
	return historyRef.FindString(line)
}

// TestNoHistoryReferences fails on any tracked text file that refers to development history by
// number, naming each file:line.
func TestNoHistoryReferences(t *testing.T) {
	_, files := trackedTextFiles(t)
	for _, f := range files {
		var hits []string
		lines(f.data, func(n int, line string) {
			if m := historyRefIn(line); m != "" {
				hits = append(hits, fmt.Sprintf("%s:%d: %q in %s", f.path, n, m, strings.TrimSpace(line)))
			}
		})
		if len(hits) > 0 {
			t.Errorf("%s refers to development history by number; say what is true instead (history is git log):\n  %s",
				f.path, strings.Join(hits, "\n  "))
		}
	}
}

// TestHistoryRefPattern checks the pattern on the forms history references take, and on text
// that merely mentions sessions and issues. The positive cases spell one letter as an escape, so
// that this file's own text holds no reference for TestNoHistoryReferences to find.
func TestHistoryRefPattern(t *testing.T) {
	for _, tc := range []struct {
		text string
		want bool
	}{
		{"see iss\x75e 16's figures", true},
		{"Iss\x75e 15, sess\x69on 29: where the time goes", true},
		{"the targets of iss\x75es 5 and 16", true},
		{"the sess\x69on-12 restructuring", true},
		{"(bench/README, Sess\x69on 27)", true},
		{"iss\x75e #42", true},
		{"UDP sessions end after --udp-timeout", false},
		{"session affinity of 10800 s", false},
		{"an issue with 2 endpoints", false},
		{"no \"session N\" or \"issue N\" in code", false},
		{"the image registry.k8s.io/e2e-test-images/regression-iss\x75e-74839:1.4", false},
		{"regression-iss\x75e-74839 and iss\x75e 7", true},
	} {
		if got := historyRefIn(tc.text) != ""; got != tc.want {
			t.Errorf("historyRefIn(%q) = %v, want %v", tc.text, got, tc.want)
		}
	}
}

// benchREADMECitation matches a citation of a heading of the benchmark's README: its path
// (with or without ".md", perhaps closing a parenthesis), a comma, and the heading in quotes.
var benchREADMECitation = regexp.MustCompile(`bench/README(?:\.md)?\)?,? "([^"]+)"`)

// TestBenchREADMECitationsExist fails on a citation of a bench/README.md heading that the file
// does not have.
func TestBenchREADMECitationsExist(t *testing.T) {
	root, files := trackedTextFiles(t)
	readme, err := os.ReadFile(filepath.Join(root, "bench", "README.md"))
	if err != nil {
		t.Fatalf("read bench/README.md: %v", err)
	}
	var headings []string
	lines(readme, func(_ int, line string) {
		if strings.HasPrefix(line, "#") {
			headings = append(headings, strings.TrimSpace(strings.TrimLeft(line, "#")))
		}
	})
	// A citation names a heading, or its part before a colon ("Scale" for "Scale: at 10,000").
	cited := func(c string) bool {
		for _, h := range headings {
			if h == c || strings.HasPrefix(h, c+":") {
				return true
			}
		}
		return false
	}
	for _, f := range files {
		lines(f.data, func(n int, line string) {
			for _, m := range benchREADMECitation.FindAllStringSubmatch(line, -1) {
				if !cited(m[1]) {
					t.Errorf("%s:%d cites bench/README.md heading %q, which it does not have", f.path, n, m[1])
				}
			}
		})
	}
}
