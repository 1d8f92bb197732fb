package manifests

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// writeServices writes files×perFile services, each with an EndpointSlice, into dir.
func writeServices(b *testing.B, dir string, files, perFile int) {
	b.Helper()
	for i := 0; i < files; i++ {
		var sb strings.Builder
		for j := 0; j < perFile; j++ {
			name := fmt.Sprintf("s%d-%d", i, j)
			fmt.Fprintf(&sb, "---\n%s---\n%s", service(name, 80, ""),
				strings.NewReplacer("name: a-1", "name: "+name+"-1", "service-name: a", "service-name: "+name).Replace(sliceA))
		}
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d.yaml", i)), []byte(sb.String()), 0o644); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkIdleScan is the cost of one rescan when nothing changed (the steady state, once a
// second by default) over 1,000 services and 1,000 EndpointSlices in 10 files.
func BenchmarkIdleScan(b *testing.B) {
	dir := b.TempDir()
	writeServices(b, dir, 10, 100)
	s := New(dir, Options{})
	if err := s.prepare(); err != nil {
		b.Fatal(err)
	}
	r := newRec(b)
	if err := s.scan(r, true); err != nil {
		b.Fatal(err)
	}
	if len(r.objects) != 2000 {
		b.Fatalf("%d objects", len(r.objects))
	}
	// Let the files settle so that they are not re-read as racy.
	for _, st := range s.files {
		st.racy = false
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := s.scan(r, false); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFullScan is the cost of the first scan: read, decode, validate, allocate and
// deliver 1,000 services and 1,000 EndpointSlices.
func BenchmarkFullScan(b *testing.B) {
	dir := b.TempDir()
	writeServices(b, dir, 10, 100)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		s := New(dir, Options{})
		if err := s.prepare(); err != nil {
			b.Fatal(err)
		}
		if err := s.scan(newRec(b), true); err != nil {
			b.Fatal(err)
		}
	}
}
