package manifests

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/rs/zerolog"
)

// TestManyInvalidDocumentsLogCapped reads a file of 30,000 tiny invalid documents: it logs at
// most maxErrorsKept errors and one summary line counting the rest, and its good objects (and
// those kept from before) still serve.
func TestManyInvalidDocumentsLogCapped(t *testing.T) {
	const n = 30_000 // small enough for a few seconds under -race; the cap does not depend on it
	f := newFixture(t, Options{})
	path := filepath.Join(f.dir, "big.yaml")
	good := service("a", 80, "") + "---\n" + service("b", 80, "")
	f.write(t, "big.yaml", good)
	f.scan(t)
	expect(t, "initial", f.rec, "add Service default/a", "add Service default/b")
	f.logs.take(t, zerolog.DebugLevel)

	// a changes, b's document breaks (it keeps serving), and n tiny documents are invalid.
	f.write(t, "big.yaml", service("a", 81, "")+"---\n"+service("b", 80, "    bogus: 1\n")+strings.Repeat("---\nx: 1\n", n))
	f.scan(t)
	expect(t, "broken", f.rec, "update Service default/a")
	if got := f.rec.served(); !slices.Equal(got, []string{"Service default/a", "Service default/b"}) {
		t.Errorf("served %q", got)
	}
	var lines []map[string]any
	for _, l := range f.logs.take(t, zerolog.InfoLevel) {
		if l["file"] == path {
			lines = append(lines, l)
		}
	}
	if len(lines) > maxErrorsKept+1 {
		t.Fatalf("%d log lines for the file, want at most %d", len(lines), maxErrorsKept+1)
	}
	last := lines[len(lines)-1]
	wantMore := fmt.Sprintf("and %d more errors in %s", n+1-maxErrorsKept, path)
	if !strings.HasPrefix(fmt.Sprint(last["message"]), wantMore) || last["errors"] != float64(n+1) || last["keptFromBefore"] != 1.0 {
		t.Errorf("summary %v, want %q with the counts", last, wantMore)
	}
	if lines[0]["object"] != "Service default/b" || lines[0]["field"] != "spec.ports[0].bogus" {
		t.Errorf("first error %v, want b's unknown field", lines[0])
	}
}

// TestManyIgnoredDocumentsLogCapped: documents of other kinds are logged at debug level, also at
// most maxErrorsKept of them per read.
func TestManyIgnoredDocumentsLogCapped(t *testing.T) {
	f := newFixture(t, Options{})
	f.write(t, "cm.yaml", strings.Repeat("---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n", 1000))
	f.scan(t)
	lines := f.logs.take(t, zerolog.DebugLevel)
	var ignored int
	var summary map[string]any
	for _, l := range lines {
		switch l["message"] {
		case "ignoring object of a kind this source does not serve":
			ignored++
		case "manifest file loaded":
			summary = l
		}
	}
	if ignored != maxErrorsKept || summary == nil || summary["ignored"] != 1000.0 {
		t.Errorf("%d debug lines for ignored documents, summary %v; want %d and a count of 1000", ignored, summary, maxErrorsKept)
	}
}

// TestDecodeKeepsFewErrors: decodeFile keeps the first maxErrorsKept errors and counts the rest,
// and lists only the failed objects it is asked to track.
func TestDecodeKeepsFewErrors(t *testing.T) {
	var b strings.Builder
	for i := 0; i < 100; i++ {
		fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Service\nmetadata: {name: s%d}\n", i) // no ports
	}
	res := newDecoder().decodeFile("/m/f.yaml", false, []byte(b.String()), func(k objKey) bool { return k.Name == "s7" || k.Name == "s70" })
	if len(res.errs) != maxErrorsKept || res.errCount != 100 || res.unidentified {
		t.Errorf("%d errors kept of %d, unidentified %v; want %d of 100", len(res.errs), res.errCount, res.unidentified, maxErrorsKept)
	}
	if got := keyStrings(res.failed); !slices.Equal(got, []string{"Service default/s7", "Service default/s70"}) {
		t.Errorf("failed %q, want the two tracked", got)
	}
	if !strings.Contains(res.errs[maxErrorsKept-1].Error(), "s19") {
		t.Errorf("last error kept %q, want the 20th document's", res.errs[maxErrorsKept-1])
	}
}
