package testenv

import (
	"fmt"
	"strings"
	"testing"
)

// recorder is a testing.TB that records Skipf and Fatalf instead of ending the test.
type recorder struct {
	testing.TB
	skipped, failed string
}

func (r *recorder) Helper()                        {}
func (r *recorder) Skipf(format string, a ...any)  { r.skipped = fmt.Sprintf(format, a...) }
func (r *recorder) Fatalf(format string, a ...any) { r.failed = fmt.Sprintf(format, a...) }

func TestNeed(t *testing.T) {
	for _, tc := range []struct {
		name, all, reason string
		skip, fail        bool
	}{
		{name: "met", reason: ""},
		{name: "met, all tiers", all: "1", reason: ""},
		{name: "missing: skipped", reason: "root", skip: true},
		{name: "missing, all tiers: failed", all: "1", reason: "root", fail: true},
		{name: "missing, KUP_TEST_ALL other than 1: skipped", all: "yes", reason: "root", skip: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(AllVar, tc.all)
			r := &recorder{TB: t}
			Need(r, tc.reason)
			if (r.skipped != "") != tc.skip || (r.failed != "") != tc.fail {
				t.Fatalf("skipped %q, failed %q; want skip %v, fail %v", r.skipped, r.failed, tc.skip, tc.fail)
			}
			for _, msg := range []string{r.skipped, r.failed} {
				if msg != "" && !strings.Contains(msg, tc.reason) {
					t.Errorf("message %q does not name what is missing (%q)", msg, tc.reason)
				}
			}
		})
	}
}

func TestTool(t *testing.T) {
	t.Setenv(AllVar, "")
	r := &recorder{TB: t}
	Tool(r, "a hint", "go-test-no-such-tool-a", "go-test-no-such-tool-b")
	if !strings.Contains(r.skipped, "go-test-no-such-tool-a, go-test-no-such-tool-b") || !strings.Contains(r.skipped, "a hint") {
		t.Errorf("skip message %q: want both tools and the hint", r.skipped)
	}
	if why := Tools("", "go-test-no-such-tool")(); why == "" {
		t.Error("Tools: a missing tool is not reported")
	}
}
