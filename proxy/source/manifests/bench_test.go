package manifests

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// servicesFile returns the content of a file of perFile services s<file>-<j>, each with an
// EndpointSlice; extra more services are appended.
func servicesFile(file, perFile, extra int) string {
	var sb strings.Builder
	for j := 0; j < perFile+extra; j++ {
		name := fmt.Sprintf("s%d-%d", file, j)
		fmt.Fprintf(&sb, "---\n%s---\n%s", service(name, 80, ""),
			strings.NewReplacer("name: a-1", "name: "+name+"-1", "service-name: a", "service-name: "+name).Replace(sliceA))
	}
	return sb.String()
}

// writeServices writes files×perFile services, each with an EndpointSlice, into dir.
func writeServices(b *testing.B, dir string, files, perFile int) {
	b.Helper()
	for i := 0; i < files; i++ {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d.yaml", i)), []byte(servicesFile(i, perFile, 0)), 0o644); err != nil {
			b.Fatal(err)
		}
	}
}

// scales are the sizes of the benchmarks: files × services per file.
var scales = []struct{ files, perFile int }{{10, 100}, {10, 1000}}

func scaleName(files, perFile int) string {
	return fmt.Sprintf("services=%d", files*perFile)
}

// loadedSource returns a Source that has read and delivered dir, its files settled.
func loadedSource(b *testing.B, dir string) (*Source, *fakeClock, *rec) {
	s, clock, r := scannedSource(b, dir, Options{}, nil)
	for _, st := range s.files {
		st.racy = false // not re-read as written too recently
	}
	return s, clock, r
}

// BenchmarkIdleScan is the cost of one rescan when nothing changed (the steady state, once a
// second by default): services and as many EndpointSlices in 10 files.
func BenchmarkIdleScan(b *testing.B) {
	for _, sc := range scales {
		b.Run(scaleName(sc.files, sc.perFile), func(b *testing.B) {
			dir := b.TempDir()
			writeServices(b, dir, sc.files, sc.perFile)
			s, _, r := loadedSource(b, dir)
			if len(r.objects) != 2*sc.files*sc.perFile {
				b.Fatalf("%d objects", len(r.objects))
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := s.scan(r, false); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkFullScan is the cost of the first scan: read, decode, validate, allocate and
// deliver the services and as many EndpointSlices in 10 files.
func BenchmarkFullScan(b *testing.B) {
	for _, sc := range scales {
		b.Run(scaleName(sc.files, sc.perFile), func(b *testing.B) {
			dir := b.TempDir()
			writeServices(b, dir, sc.files, sc.perFile)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				loadedSource(b, dir)
			}
		})
	}
}

// BenchmarkDecode is the cost of decoding the content of 10 files of services and their
// EndpointSlices, in parallel (GOMAXPROCS workers) and on one goroutine.
func BenchmarkDecode(b *testing.B) {
	for _, sc := range scales {
		var jobs []*fileJob
		for i := range sc.files {
			jobs = append(jobs, &fileJob{path: fmt.Sprintf("f%d.yaml", i), data: []byte(servicesFile(i, sc.perFile, 0)), track: trackAll})
		}
		for _, workers := range []int{0, 1} {
			b.Run(fmt.Sprintf("%s/workers=%d", scaleName(sc.files, sc.perFile), workers), func(b *testing.B) {
				d := newDecoder()
				for i := 0; i < b.N; i++ {
					for _, res := range d.decodeFiles(jobs, workers) {
						if len(res.objects) != 2*sc.perFile {
							b.Fatalf("%d objects", len(res.objects))
						}
					}
				}
			})
		}
	}
}

// BenchmarkOneFileChange is the cost of one more service in one of 10 files, from the scan
// that finds the file changed to the delivery of the service and its EndpointSlice: read,
// decode (the file's other documents come from the cache), merge, allocate, deliver.
func BenchmarkOneFileChange(b *testing.B) {
	for _, sc := range scales {
		b.Run(scaleName(sc.files, sc.perFile), func(b *testing.B) {
			dir := b.TempDir()
			writeServices(b, dir, sc.files, sc.perFile)
			s, clock, r := loadedSource(b, dir)
			contents := [2][]byte{[]byte(servicesFile(0, sc.perFile, 1)), []byte(servicesFile(0, sc.perFile, 0))}
			path := filepath.Join(dir, "f0.yaml")
			r.take()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				if err := os.WriteFile(path, contents[i%2], 0o644); err != nil {
					b.Fatal(err)
				}
				if _, err := s.scan(r, false); err != nil { // sees the change
					b.Fatal(err)
				}
				clock.advance(s.opts.debounce())
				b.StartTimer()
				if _, err := s.scan(r, false); err != nil { // reads it
					b.Fatal(err)
				}
				if got := r.take(); len(got) != 2 {
					b.Fatalf("delivered %v, want the add or delete of one service and its slice", got)
				}
			}
		})
	}
}

// discardHandler takes the source's calls and keeps nothing.
type discardHandler struct{}

func (discardHandler) OnServiceUpdate(_, _ *v1.Service)                    {}
func (discardHandler) OnEndpointSliceUpdate(_, _ *discovery.EndpointSlice) {}
func (discardHandler) OnSynced()                                           {}

// BenchmarkSourceMemory reports what a loaded source holds per service (with its EndpointSlice)
// at 10,000 services in 10 files: the live heap after a collection, less the one before it was
// made, the handler keeping nothing. "allocated": the manifests give no cluster IP; "explicit":
// each gives its own.
func BenchmarkSourceMemory(b *testing.B) {
	const files, perFile = 10, 1000
	for _, c := range []struct {
		name     string
		explicit bool
	}{{"allocated", false}, {"explicit", true}} {
		b.Run(c.name, func(b *testing.B) {
			dir := b.TempDir()
			for i := range files {
				content := servicesFile(i, perFile, 0)
				if c.explicit {
					var sb strings.Builder
					for j, doc := range strings.Split(content, "\nspec:\n") {
						if j > 0 {
							n := i*perFile + j - 1
							fmt.Fprintf(&sb, "\nspec:\n  clusterIP: 10.96.%d.%d\n", n>>8, n&0xff)
						}
						sb.WriteString(doc)
					}
					content = sb.String()
				}
				if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d.yaml", i)), []byte(content), 0o644); err != nil {
					b.Fatal(err)
				}
			}
			var perService, inusePerService float64
			for range b.N {
				before, inuseBefore := heapAfterGC()
				s := New(dir, Options{})
				clock := newFakeClock()
				s.now = clock.now
				if err := s.prepare(); err != nil {
					b.Fatal(err)
				}
				settledScan(b, s, clock, discardHandler{}, true)
				if n := len(s.delivered); n != 2*files*perFile {
					b.Fatalf("%d objects delivered, want %d", n, 2*files*perFile)
				}
				after, inuseAfter := heapAfterGC()
				perService = float64(after-before) / (files * perFile)
				inusePerService = float64(inuseAfter-inuseBefore) / (files * perFile)
				runtime.KeepAlive(s)
			}
			b.ReportMetric(perService, "B/service")
			// In use: the heap's spans holding objects, with the free slots between them (what
			// decoding's garbage leaves behind counts here, not in B/service).
			b.ReportMetric(inusePerService, "inuse-B/service")
		})
	}
}

// heapAfterGC returns, after a collection, the bytes of live objects and of the heap's spans in
// use (live objects plus the free slots of partly used spans).
func heapAfterGC() (live, inuse int64) {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc), int64(ms.HeapInuse)
}
