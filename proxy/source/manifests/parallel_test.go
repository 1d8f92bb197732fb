package manifests

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

// sameResult reports how got differs from want ("" when it does not): the same objects at the
// same positions, the same errors in the same order, the same counts; failed as a set.
func sameResult(want, got *fileResult) string {
	objs := func(r *fileResult) []string {
		var out []string
		for _, e := range r.objects {
			out = append(out, e.key.String()+" at "+e.pos.where())
		}
		return out
	}
	errs := func(r *fileResult) []string {
		var out []string
		for _, e := range r.errs {
			out = append(out, e.Error())
		}
		return out
	}
	skipped := func(r *fileResult) []string {
		var out []string
		for _, s := range r.skipped {
			out = append(out, s.where+" "+s.kind+" "+s.name)
		}
		return out
	}
	failed := func(r *fileResult) []string { return slices.Sorted(slices.Values(keyStrings(r.failed))) }
	switch {
	case !slices.Equal(objs(want), objs(got)):
		return fmt.Sprintf("objects %q, want %q", objs(got), objs(want))
	case !slices.Equal(errs(want), errs(got)) || want.errCount != got.errCount:
		return fmt.Sprintf("%d errors %q, want %d %q", got.errCount, errs(got), want.errCount, errs(want))
	case !slices.Equal(skipped(want), skipped(got)) || want.skippedCount != got.skippedCount:
		return fmt.Sprintf("%d skipped %q, want %d %q", got.skippedCount, skipped(got), want.skippedCount, skipped(want))
	case !slices.Equal(failed(want), failed(got)):
		return fmt.Sprintf("failed %q, want %q", failed(got), failed(want))
	case want.unidentified != got.unidentified:
		return fmt.Sprintf("unidentified %v, want %v", got.unidentified, want.unidentified)
	}
	return ""
}

// checkParallel decodes data in one piece, in spans of a document or so on several goroutines,
// converting and decoding one document at a time, and again with the cache of the first decode,
// and fails unless all four agree.
func checkParallel(t *testing.T, data []byte, isJSON bool) {
	t.Helper()
	seq := newDecoder().decodeFile("/m/f.yaml", isJSON, data, trackAll)
	par := newDecoder()
	par.minSpan = 1
	job := &fileJob{path: "/m/f.yaml", isJSON: isJSON, data: data, track: trackAll}
	if diff := sameResult(seq, par.decodeFiles([]*fileJob{job}, 4)[0]); diff != "" {
		t.Fatalf("decoded in spans: %s", diff)
	}
	small := newDecoder()
	small.batch = 1 // decoded as soon as converted: a batch of one document
	if diff := sameResult(seq, small.decodeFile("/m/f.yaml", isJSON, data, trackAll)); diff != "" {
		t.Fatalf("decoded in batches of one document: %s", diff)
	}
	objects := map[objKey]*entry{}
	for _, e := range seq.objects {
		objects[e.key] = e
	}
	job.cache = cacheOf(objects)
	cached := par.decodeFiles([]*fileJob{job}, 4)[0]
	if diff := sameResult(seq, cached); diff != "" {
		t.Fatalf("decoded with the cache: %s", diff)
	}
	for _, e := range cached.objects {
		if i := slices.IndexFunc(seq.objects, func(s *entry) bool { return s.key == e.key }); i >= 0 &&
			seq.objects[i].svc != nil && e.svc != seq.objects[i].svc && seq.objects[i].pos.item < 0 {
			t.Errorf("%s decoded again despite the cache", e.key)
		}
	}
}

// TestParallelDecodeIsSequentialDecode: a file decoded in spans, in parallel, and from the
// cache of its previous content gives what decoding it in one piece gives, duplicates across
// spans, capped errors and Lists included.
func TestParallelDecodeIsSequentialDecode(t *testing.T) {
	var b strings.Builder
	for i := range 60 {
		switch i % 6 {
		case 0, 1:
			fmt.Fprintf(&b, "---\n%s", service(fmt.Sprintf("s%d", i), 80, ""))
		case 2:
			fmt.Fprintf(&b, "---\n%s", service(fmt.Sprintf("s%d", i-2), 80, "")) // a duplicate of an earlier one
		case 3:
			fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Service\nmetadata: {name: bad%d}\n", i) // no ports
		case 4:
			fmt.Fprintf(&b, "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: c%d}\n", i)
		case 5:
			item := strings.ReplaceAll(strings.TrimSuffix(service(fmt.Sprintf("l%d", i), 80, ""), "\n"), "\n", "\n  ")
			fmt.Fprintf(&b, "---\napiVersion: v1\nkind: List\nbogus: 1\nitems:\n- %s\n- %s\n", item, strings.ReplaceAll(item, "name: l", "name: s"))
		}
	}
	b.WriteString("---\n" + service("s0", 81, "")) // defined again, last
	checkParallel(t, []byte(b.String()), false)
}
