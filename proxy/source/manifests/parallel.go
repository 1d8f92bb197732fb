package manifests

import (
	"cmp"
	"crypto/sha256"
	"runtime"
	"slices"

	"golang.org/x/sync/errgroup"
)

// Parallel decoding.
//
// Decoding is most of the cost of a scan that reads files (YAML to JSON, then strict JSON into
// the k8s.io/api types): about 100 µs per document. The files to read in one scan are cut into
// spans of whole documents, at most spansPerWorker per worker and file and none smaller than
// minSpanBytes, and the spans of all the files are decoded on up to GOMAXPROCS goroutines at a
// time. Each span has a result of its own, with at most maxErrorsKept errors; assemble joins a
// file's spans in order into what decoding the file in one piece gives: the same objects, the
// same errors in the same order (duplicates across spans are found there), the same counts.
//
// A file's documents that decoded into one object without errors are remembered by the hash of
// their bytes (docCache); when the file changes, its unchanged documents are taken from there,
// not decoded again, so editing one service of a file of 10,000 decodes one document.

const (
	minSpanBytes   = 64 << 10
	spansPerWorker = 2
)

// docCache maps the SHA-256 of a document's bytes to the object it decoded into: the cacheable
// objects of a file's last decoded content (see entry.cacheable). It is made from the file's
// objects when the file has changed and is decoded again, not kept: at 10,000 services a kept
// map per file cost ~2.5 MB; the entries hold their documents' sums instead.
type docCache map[[sha256.Size]byte]*entry

// cacheOf returns the cache of a file's objects: the cacheable ones, not those kept from an
// earlier content (stale); nil when there are none.
func cacheOf(objects map[objKey]*entry) docCache {
	var c docCache
	for _, e := range objects {
		if e.cacheable && !e.stale {
			if c == nil {
				c = make(docCache, len(objects))
			}
			c[e.sum] = e
		}
	}
	return c
}

// fileJob is one file's content to decode.
type fileJob struct {
	path   string
	isJSON bool
	data   []byte
	// track tells which failed objects to list (see fileResult.failed). It is called from several
	// goroutines and must only read.
	track func(objKey) bool
	// cache holds the documents of the file's previous content (read only); nil for none.
	cache docCache
}

// span is a run of whole documents of a file's content.
type span struct {
	data     []byte
	line     int // line of the file where data starts
	firstDoc int // 1-based index in the file of its first document
}

// spans cuts a file's content into at most n spans of at least minBytes each (but one), at the
// start of documents.
func spans(job *fileJob, n, minBytes int) []span {
	all := span{data: job.data, line: 1, firstDoc: 1}
	if job.isJSON || n <= 1 || len(job.data) < 2*minBytes || len(job.data) > maxFileSize {
		return []span{all}
	}
	size := max(len(job.data)/n, minBytes)
	var out []span
	start, startLine, startDoc, i := 0, 1, 1, 0
	for doc := range documents(job.data) {
		i++
		off := offsetIn(job.data, doc.data)
		if off-start >= size && len(out) < n-1 {
			out = append(out, span{data: job.data[start:off], line: startLine, firstDoc: startDoc})
			start, startLine, startDoc = off, doc.line, i
		}
	}
	return append(out, span{data: job.data[start:], line: startLine, firstDoc: startDoc})
}

// offsetIn returns where sub, a slice of data, starts in data.
func offsetIn(data, sub []byte) int {
	return cap(data) - cap(sub)
}

// decodeFiles decodes the jobs' contents with up to workers goroutines (GOMAXPROCS when 0) and
// returns their results in the jobs' order. It returns when all are done.
func (d *decoder) decodeFiles(jobs []*fileJob, workers int) []*fileResult {
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	type unit struct {
		job  int
		span span
		res  *fileResult
	}
	n := 1 // spans per file: decoding with one worker decodes each file in one piece
	if workers > 1 {
		n = workers * spansPerWorker
	}
	var units []unit
	for j, job := range jobs {
		for _, sp := range spans(job, n, cmp.Or(d.minSpan, minSpanBytes)) {
			units = append(units, unit{job: j, span: sp})
		}
	}
	var g errgroup.Group
	g.SetLimit(workers)
	for i := range units {
		g.Go(func() error {
			units[i].res = d.decodeSpan(jobs[units[i].job], units[i].span)
			return nil
		})
	}
	_ = g.Wait() // the units return no error
	out := make([]*fileResult, len(jobs))
	for first := 0; first < len(units); {
		last := first + 1
		for last < len(units) && units[last].job == units[first].job {
			last++
		}
		parts := make([]*fileResult, 0, last-first)
		for _, u := range units[first:last] {
			parts = append(parts, u.res)
		}
		out[units[first].job] = assemble(jobs[units[first].job], parts)
		first = last
	}
	return out
}

// assemble joins the results of a file's spans, in order, into the file's result: an object
// already defined in an earlier span is a duplicate, reported in document order among the
// other errors, which are capped at maxErrorsKept as a whole.
func assemble(job *fileJob, parts []*fileResult) *fileResult {
	if len(parts) == 1 {
		return parts[0]
	}
	res := &fileResult{}
	seen := map[objKey]docPos{}
	for _, p := range parts {
		var dups []*DocError
		for _, e := range p.objects {
			if first, dup := seen[e.key]; dup {
				dups = append(dups, duplicateErr(res, job, e, first))
				continue
			}
			seen[e.key] = e.pos
			res.objects = append(res.objects, e)
		}
		res.failed = append(res.failed, p.failed...)
		res.unidentified = res.unidentified || p.unidentified
		res.errCount += p.errCount
		for _, e := range mergeByPosition(p.errs, dups) {
			if !res.full() {
				res.errs = append(res.errs, e)
			}
		}
		res.skippedCount += p.skippedCount
		res.skipped = append(res.skipped, p.skipped[:min(len(p.skipped), maxErrorsKept-len(res.skipped))]...)
	}
	return res
}

// duplicateErr counts, in res, an object defined again in a later span than its first
// definition, and returns the error for it.
func duplicateErr(res *fileResult, job *fileJob, e *entry, first docPos) *DocError {
	if job.track(e.key) {
		res.failed = append(res.failed, e.key)
	}
	res.errCount++
	return duplicateError(job.path, e.pos, e.key, first)
}

// mergeByPosition merges two lists of errors, each in document order, into one.
func mergeByPosition(a, b []*DocError) []*DocError {
	if len(b) == 0 {
		return a
	}
	out := slices.Concat(a, b)
	slices.SortStableFunc(out, func(x, y *DocError) int {
		return cmp.Or(cmp.Compare(x.Doc, y.Doc), cmp.Compare(x.Item, y.Item))
	})
	return out
}
