package app

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

// TestConfigurationDocIsGenerated fails when docs/configuration.md is not what the flag set
// renders today: a flag added, removed or reworded without regenerating the reference.
func TestConfigurationDocIsGenerated(t *testing.T) {
	path := filepath.Join("..", "..", "..", filepath.FromSlash(ConfigurationDoc))
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read %s: %v; generate it with `%s` from the repository's root", ConfigurationDoc, err, RegenerateCommand)
	}
	want := ConfigurationReference()
	if bytes.Equal(got, want) {
		return
	}
	gotLines, wantLines := strings.Split(string(got), "\n"), strings.Split(string(want), "\n")
	for i := 0; i < len(gotLines) || i < len(wantLines); i++ {
		var g, w string
		if i < len(gotLines) {
			g = gotLines[i]
		}
		if i < len(wantLines) {
			w = wantLines[i]
		}
		if g != w {
			t.Fatalf("%s differs from the flag set at line %d:\n  file:      %q\n  generated: %q\nregenerate it with `%s` from the repository's root",
				ConfigurationDoc, i+1, g, w, RegenerateCommand)
		}
	}
}

// TestConfigurationReferenceListsEveryFlag checks the renderer itself: every flag of the flag
// set appears once, and the configuration field its help names is the one the file sets.
func TestConfigurationReferenceListsEveryFlag(t *testing.T) {
	doc := string(ConfigurationReference())
	o := NewOptions()
	fields := map[string]string{}
	for _, f := range configFields {
		fields[f.flag] = f.field
	}
	n := 0
	for _, g := range o.FlagGroups() {
		if !strings.Contains(doc, "\n## "+g.Name+"\n") {
			t.Errorf("group %q has no section", g.Name)
		}
		g.Flags.VisitAll(func(f *pflag.Flag) {
			n++
			if c := strings.Count(doc, "- **`--"+f.Name+"`** "); c != 1 {
				t.Errorf("--%s listed %d times", f.Name, c)
			}
			m := configMarker.FindStringSubmatch(f.Usage)
			switch {
			case m != nil && fields[f.Name] != m[1]:
				t.Errorf("--%s: help names file field %q, but the file's %q sets it", f.Name, m[1], fields[f.Name])
			case m == nil && fields[f.Name] != "":
				t.Errorf("--%s: the file's %q sets it, but its help does not say so ([config: %s])", f.Name, fields[f.Name], fields[f.Name])
			}
		})
	}
	if n < 10 {
		t.Fatalf("only %d flags rendered: the checks above would pass vacuously", n)
	}
	for _, f := range configFields {
		if !strings.Contains(doc, "| `"+f.field+"` | `--"+f.flag+"` |") {
			t.Errorf("file field %s (--%s) missing from the field table", f.field, f.flag)
		}
	}
	if !strings.Contains(doc, "- `featureGates`: ") {
		t.Errorf("the ignored fields are not listed (featureGates missing)")
	}
}
