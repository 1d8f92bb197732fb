package manifests

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"sigs.k8s.io/yaml"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// Kinds this source serves, and the list kinds it unpacks.
const (
	kindService           = "Service"
	kindEndpointSlice     = "EndpointSlice"
	kindList              = "List"
	kindServiceList       = "ServiceList"
	kindEndpointSliceList = "EndpointSliceList"
)

var (
	coreV1      = v1.SchemeGroupVersion.String()        // "v1"
	discoveryV1 = discovery.SchemeGroupVersion.String() // "discovery.k8s.io/v1"
)

// objKey identifies an object: kind, namespace and name.
type objKey struct {
	Kind      string
	Namespace string
	Name      string
}

// String returns "Kind namespace/name", the form used in logs and proxy.FieldError.
func (k objKey) String() string { return k.Kind + " " + k.Namespace + "/" + k.Name }

// entry is one decoded, defaulted and validated object of one file.
type entry struct {
	key   objKey
	svc   *v1.Service // set for kind Service
	slice *sliceDoc   // set for kind EndpointSlice
	pos   docPos      // where in its file
	// stale is true when the object is the last good version kept from an earlier content of
	// the file, because the current content failed to decode where the object may be.
	stale bool
	// cacheable is true when the object is all its document decoded into, without errors (not a
	// List item); sum is then the SHA-256 of the document's bytes. When the file changes, a
	// document of the same bytes is taken from here, not decoded again (see docCache).
	cacheable bool
	sum       [sha256.Size]byte
}

// sliceDoc is an EndpointSlice as the source keeps it: its protobuf encoding, and the decoded
// object only from its decoding until the end of the scan that delivered it. The decoded object
// of a slice of one endpoint is ~1.2 KB (its labels map alone ~450 B), its protobuf ~110 B (its
// JSON ~300), and the proxy keeps what a slice contributes, not the slice
// (proxy.SliceEndpoints): at 10,000 services this is ~10 MB. The rare paths that hand out a
// slice that was not decoded in the same scan (the previous version of an update or a delete,
// another file's copy becoming the one served, a version kept from a file's earlier content)
// unmarshal it again. The encoding is deterministic (map keys sorted), so equal bytes are an
// unchanged slice.
type sliceDoc struct {
	pb  []byte                   // the defaulted object, protobuf-encoded; never changed
	obj *discovery.EndpointSlice // the decoded, defaulted object; nil once released
}

// newSliceDoc holds obj, decoded, defaulted and validated.
func newSliceDoc(obj *discovery.EndpointSlice) *sliceDoc {
	pb, err := obj.Marshal()
	if err != nil {
		pb = nil // cannot happen for a valid object; the object is then kept, never released
	}
	return &sliceDoc{pb: pb, obj: obj}
}

// release lets the decoded object go (it has been delivered, or is not served).
func (sd *sliceDoc) release() {
	if sd.pb != nil {
		sd.obj = nil
	}
}

// same reports whether sd and o hold the same slice.
func (sd *sliceDoc) same(o *sliceDoc) bool {
	return sd == o || (sd.pb != nil && bytes.Equal(sd.pb, o.pb))
}

// slice returns sd's decoded object, unmarshalling it again when it was released.
func (d *decoder) slice(sd *sliceDoc) (*discovery.EndpointSlice, error) {
	if sd.obj != nil {
		return sd.obj, nil
	}
	o := &discovery.EndpointSlice{}
	if err := o.Unmarshal(sd.pb); err != nil {
		return nil, fmt.Errorf("unmarshal a kept EndpointSlice again: %w", err)
	}
	o.APIVersion, o.Kind = discoveryV1, kindEndpointSlice // not part of the encoding
	return o, nil
}

// docPos is where an object is in its file: document doc (1-based) starting at line, and item of
// the document's List (-1 when the document is not a List).
type docPos struct {
	doc, line, item int
}

// where returns "document 2 (line 14)" or "document 1 (line 1) items[3]".
func (p docPos) where() string {
	e := DocError{Doc: p.doc, Line: p.line, Item: p.item}
	return e.Where()
}

// DocError is a problem with one document (or one List item) of one manifest file. The object
// it names, if any, is skipped; its last good version keeps serving.
type DocError struct {
	File   string // path of the file
	Doc    int    // 1-based index of the document in the file (YAML documents separated by ---); 0 for the whole file
	Line   int    // line of the file where the document starts; 0 when not known
	Item   int    // index in a List's items; -1 when the document is not a List
	Object string // "Service ns/name" or "EndpointSlice ns/name"; "" when the object is not known
	Field  string // the offending field(s), when known
	Detail string
}

// Where returns the position of the problem inside its file: "document 2 (line 14) items[3]".
func (e *DocError) Where() string {
	if e.Doc == 0 {
		return "whole file"
	}
	s := "document " + strconv.Itoa(e.Doc)
	if e.Line > 0 {
		s += " (line " + strconv.Itoa(e.Line) + ")"
	}
	if e.Item >= 0 {
		s += " items[" + strconv.Itoa(e.Item) + "]"
	}
	return s
}

func (e *DocError) Error() string {
	var b strings.Builder
	b.WriteString(e.File + ": " + e.Where())
	if e.Object != "" {
		b.WriteString(": " + e.Object)
	}
	if e.Field != "" {
		b.WriteString(": " + e.Field)
	}
	b.WriteString(": " + e.Detail)
	return b.String()
}

// maxErrorsKept is how many errors (and how many ignored documents) of one file's content are
// kept, and so logged, per read; the rest are only counted. A file of a million broken documents
// must not cost a million log lines, nor the memory to hold them.
const maxErrorsKept = 20

// fileResult is what decoding one file's content produced.
type fileResult struct {
	objects []*entry
	// failed lists the objects whose document was identified but failed, among those the caller
	// asked about (see fileJob.track); their last good versions keep serving.
	failed []objKey
	// unidentified is true when some document failed before its object could be identified;
	// then every object of the file's previous content that is not in objects keeps serving.
	unidentified bool
	// errs holds the first maxErrorsKept errors; errCount counts them all.
	errs     []*DocError
	errCount int
	// skipped holds the first maxErrorsKept documents of other kinds; skippedCount counts them all.
	skipped      []skippedDoc
	skippedCount int
}

// addErr records an error, keeping it if fewer than maxErrorsKept are kept.
func (r *fileResult) addErr(e *DocError) {
	r.errCount++
	if len(r.errs) < maxErrorsKept {
		r.errs = append(r.errs, e)
	}
}

// full reports whether no more errors are kept: the next ones need not even be formatted.
func (r *fileResult) full() bool { return len(r.errs) >= maxErrorsKept }

// skippedDoc is a document of a kind this source does not serve.
type skippedDoc struct {
	where, apiVersion, kind, name string
}

// decoder decodes manifests into the k8s.io/api types, strictly: unknown, duplicate and
// mistyped fields are errors.
type decoder struct {
	codec runtime.Decoder
	// minSpan is the least size of a span decoded in parallel (see spans); 0 means minSpanBytes.
	// Tests lower it.
	minSpan int
	// batch is how much JSON decodeSpan converts before decoding it; 0 means
	// convertBatchBytes. Tests lower it.
	batch int
}

func newDecoder() *decoder {
	sc := runtime.NewScheme()
	sc.AddKnownTypes(v1.SchemeGroupVersion, &v1.Service{}, &v1.ServiceList{}, &v1.List{})
	sc.AddKnownTypes(discovery.SchemeGroupVersion, &discovery.EndpointSlice{}, &discovery.EndpointSliceList{})
	metav1.AddToGroupVersion(sc, v1.SchemeGroupVersion)
	metav1.AddToGroupVersion(sc, discovery.SchemeGroupVersion)
	return &decoder{codec: serializer.NewCodecFactory(sc, serializer.EnableStrict).UniversalDeserializer()}
}

// maxFileSize bounds what one manifest file may hold.
const maxFileSize = 32 << 20

// document is one YAML document of a file.
type document struct {
	data []byte
	line int // 1-based line of the file where it starts
}

// documents yields the documents of a YAML stream, split at lines that start with "---"
// followed only by blanks or a comment, the way kubectl does. Documents holding nothing but
// blanks and comments are left out. The documents are slices of data, produced one at a time.
func documents(data []byte) iter.Seq[document] {
	return func(yield func(document) bool) {
		start, startLine, line := 0, 1, 1
		for pos := 0; pos < len(data); line++ {
			end := bytes.IndexByte(data[pos:], '\n')
			next := len(data)
			if end >= 0 {
				end += pos
				next = end + 1
			} else {
				end = len(data)
			}
			if isSeparator(data[pos:end]) {
				if d := data[start:pos]; !blank(d) && !yield(document{data: d, line: startLine}) {
					return
				}
				start, startLine = next, line+1
			}
			pos = next
		}
		if d := data[start:]; !blank(d) {
			yield(document{data: d, line: startLine})
		}
	}
}

func isSeparator(line []byte) bool {
	if !bytes.HasPrefix(line, []byte("---")) {
		return false
	}
	rest := bytes.TrimSpace(line[3:])
	return len(rest) == 0 || rest[0] == '#'
}

// blank reports whether a YAML document holds only blanks, comments and "..." end markers.
func blank(d []byte) bool {
	for len(d) > 0 {
		l := d
		if i := bytes.IndexByte(d, '\n'); i >= 0 {
			l, d = d[:i], d[i+1:]
		} else {
			d = nil
		}
		l = bytes.TrimSpace(l)
		if len(l) != 0 && l[0] != '#' && !bytes.Equal(l, []byte("...")) {
			return false
		}
	}
	return true
}

// secondDocument returns the 1-based line of d (one document as split by documents, or a whole
// JSON-named file) where a second YAML document starts, 0 if none does: a "---" marker with
// content after it, or content after a "..." end marker. The YAML library would silently read
// the first document only.
func secondDocument(d []byte) int {
	content, ended := false, false
	for line := 1; len(d) > 0; line++ {
		l := d
		if i := bytes.IndexByte(d, '\n'); i >= 0 {
			l, d = d[:i], d[i+1:]
		} else {
			d = nil
		}
		l = bytes.TrimRight(l, " \t\r")
		marker := func(m string) bool {
			return bytes.HasPrefix(l, []byte(m)) && (len(l) == len(m) || l[len(m)] == ' ' || l[len(m)] == '\t')
		}
		switch {
		case marker("---"):
			if content {
				return line
			}
			content = true // "--- value" starts the first document explicitly
		case marker("..."):
			ended = true
		case len(bytes.TrimSpace(l)) == 0 || bytes.TrimSpace(l)[0] == '#':
		default:
			if ended {
				return line
			}
			content = true
		}
	}
	return 0
}

// decodeSpan decodes the documents of one span of a file's content into a result of its own,
// with the duplicates inside the span already found (assemble finds those across spans).
func (d *decoder) decodeSpan(job *fileJob, sp span) *fileResult {
	res := &fileResult{}
	if len(job.data) > maxFileSize {
		res.unidentified = true
		res.addErr(&DocError{File: job.path, Item: -1, Detail: fmt.Sprintf("file is larger than %d bytes", maxFileSize)})
		return res
	}
	docs := documents(sp.data)
	if job.isJSON {
		docs = func(yield func(document) bool) {
			if len(bytes.TrimSpace(sp.data)) != 0 {
				yield(document{data: sp.data, line: 1})
			}
		}
	}
	// Two passes over each batch of documents: every document new to the cache is converted to
	// JSON first, then the batch is decoded. YAML parsing makes most of the garbage of a decode;
	// done in a pass of its own, that garbage is not interleaved with the objects that stay
	// (which would leave them scattered over many partly used spans of the heap). A batch ends
	// after convertBatchBytes of JSON, which bounds what a large span holds at once.
	seen := map[objKey]docPos{}
	i := sp.firstDoc - 1
	var pending []pendingDoc
	held := 0
	flush := func() {
		for k := range pending {
			i++
			pd := &pending[k]
			d.decodeTop(res, seen, job, &DocError{File: job.path, Doc: i, Line: pd.line + sp.line - 1, Item: -1}, pd)
			pending[k] = pendingDoc{} // let the JSON go
		}
		pending, held = pending[:0], 0
	}
	for doc := range docs {
		pd := pendingDoc{document: doc, sum: sha256.Sum256(doc.data)}
		if job.cache[pd.sum] == nil {
			pd.conv = convertDocument(doc.data)
			held += len(pd.conv.js)
		}
		pending = append(pending, pd)
		if held >= cmp.Or(d.batch, convertBatchBytes) {
			flush()
		}
	}
	flush()
	return res
}

// convertBatchBytes is how much JSON decodeSpan converts before decoding it.
const convertBatchBytes = 1 << 20

// pendingDoc is a document of a span, with its hash and, unless the cache holds it, its JSON.
type pendingDoc struct {
	document
	sum  [sha256.Size]byte
	conv *converted
}

// converted is the result of toJSON for one document (or the panic it raised).
type converted struct {
	js             []byte
	strictErr, err error
}

// convertDocument runs toJSON, turning a panic of the YAML library into an error.
func convertDocument(data []byte) (c *converted) {
	c = &converted{}
	defer func() {
		if r := recover(); r != nil {
			c.js, c.strictErr, c.err = nil, nil, fmt.Errorf("internal error: panic while decoding: %v", r)
		}
	}()
	c.js, c.strictErr, c.err = toJSON(data)
	return c
}

// decodeTop decodes one document of a file, from the cache of the file's previous content when
// it holds the same bytes. It marks the objects of this content that can be served from the
// cache next time (entry.cacheable): those that are all their document decoded into, without
// errors (not a List item). Decoding is deterministic, so a cached object is what decoding
// would give.
func (d *decoder) decodeTop(res *fileResult, seen map[objKey]docPos, job *fileJob, pos *DocError, pd *pendingDoc) {
	sum := pd.sum
	if e := job.cache[sum]; e != nil {
		at := docPos{doc: pos.Doc, line: pos.Line, item: -1}
		if first, dup := seen[e.key]; dup {
			d.duplicate(res, job.track, pos, e.key, first)
			return
		}
		seen[e.key] = at
		if e.pos != at {
			c := *e
			c.pos = at
			e = &c
		}
		res.objects = append(res.objects, e) // cacheable, with its sum, already
		return
	}
	before, errs, skipped := len(res.objects), res.errCount, res.skippedCount
	d.decodeDocument(res, seen, job.track, pos, pd.data, pd.conv, true)
	if res.errCount == errs && res.skippedCount == skipped && len(res.objects) == before+1 && res.objects[before].pos.item < 0 {
		e := res.objects[before] // new: this goroutine's alone
		e.cacheable, e.sum = true, sum
	}
}

// duplicate records an object defined again in the same file (first at first): it is ignored.
func (d *decoder) duplicate(res *fileResult, track func(objKey) bool, pos *DocError, key objKey, first docPos) {
	if track(key) {
		res.failed = append(res.failed, key)
	}
	if res.full() {
		res.errCount++
		return
	}
	res.addErr(duplicateError(pos.File, docPos{doc: pos.Doc, line: pos.Line, item: pos.Item}, key, first))
}

// duplicateError is the error for an object of file at at, defined first at first.
func duplicateError(file string, at docPos, key objKey, first docPos) *DocError {
	return &DocError{File: file, Doc: at.doc, Line: at.line, Item: at.item, Object: key.String(), Field: "metadata.name",
		Detail: fmt.Sprintf("%s is defined again (first in %s); this one is ignored", key, first.where())}
}

// decodeDocument decodes one document, or one List item when top is false. pos carries the
// position for errors.
func (d *decoder) decodeDocument(res *fileResult, seen map[objKey]docPos, track func(objKey) bool, pos *DocError, data []byte, conv *converted, top bool) {
	fail := func(key *objKey, field, format string, args ...any) {
		if key != nil {
			if track(*key) {
				res.failed = append(res.failed, *key)
			}
		} else {
			res.unidentified = true
		}
		if res.full() {
			res.errCount++
			return
		}
		e := *pos
		e.Field = field
		e.Detail = fmt.Sprintf(format, args...)
		if key != nil {
			e.Object = key.String()
		}
		res.addErr(&e)
	}
	defer func() {
		if r := recover(); r != nil {
			fail(nil, "", "internal error: panic while decoding: %v", r)
		}
	}()

	if conv == nil {
		conv = convertDocument(data)
	}
	js, strictErr, err := conv.js, conv.strictErr, conv.err
	if err != nil {
		fail(nil, "", "%s", fileLines(err.Error(), pos.Line))
		return
	}
	js = bytes.TrimSpace(js)
	if bytes.Equal(js, []byte("null")) {
		return // an empty document
	}
	if len(js) == 0 || js[0] != '{' {
		fail(nil, "", "document is not a mapping of fields")
		return
	}
	// Lenient look at the identity, so that a document failing strict decoding is still known.
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name      string `json:"name"`
			Namespace string `json:"namespace"`
		} `json:"metadata"`
	}
	_ = json.Unmarshal(js, &head)
	meta := &head.Metadata
	if meta.Namespace == "" {
		meta.Namespace = metav1.NamespaceDefault
	}
	key := objKey{Kind: head.Kind, Namespace: meta.Namespace, Name: meta.Name}
	var keyp *objKey
	if meta.Name != "" {
		keyp = &key
	}
	known := head.Kind == kindService || head.Kind == kindEndpointSlice
	isList := head.Kind == kindList || head.Kind == kindServiceList || head.Kind == kindEndpointSliceList
	if strictErr != nil && (known || isList) {
		// A duplicate key: decoding would silently keep one of the values.
		if !known {
			keyp = nil
		}
		fail(keyp, errorField(strictErr.Error()), "%s", fileLines(strictErr.Error(), pos.Line))
		return
	}

	switch {
	case head.Kind == "":
		fail(nil, "kind", "missing: not a Kubernetes object")
	case isList:
		if !top {
			fail(nil, "kind", "a %s inside a List is not supported", head.Kind)
			return
		}
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(js, &fields); err != nil {
			fail(nil, "", "document is not a mapping of fields")
			return
		}
		d.decodeList(res, seen, track, pos, head.APIVersion, head.Kind, fields)
	case head.Kind == kindService && head.APIVersion != coreV1:
		fail(keyp, "apiVersion", "%q is not supported for a Service, want %q", head.APIVersion, coreV1)
	case head.Kind == kindEndpointSlice && head.APIVersion != discoveryV1:
		fail(keyp, "apiVersion", "%q is not supported for an EndpointSlice, want %q", head.APIVersion, discoveryV1)
	case known:
		if keyp == nil {
			fail(nil, "metadata.name", "missing")
			return
		}
		obj, _, err := d.codec.Decode(js, nil, nil)
		if err != nil {
			field := errorField(err.Error())
			fail(keyp, field, "%s", fileLines(err.Error(), pos.Line))
			return
		}
		e := &entry{key: key, pos: docPos{doc: pos.Doc, line: pos.Line, item: pos.Item}}
		var errs []error
		switch o := obj.(type) {
		case *v1.Service:
			errs = defaultAndValidateService(o)
			e.svc = o
		case *discovery.EndpointSlice:
			errs = defaultAndValidateSlice(o)
			e.slice = newSliceDoc(o)
		default:
			fail(keyp, "", "decoded into unexpected type %T", obj)
			return
		}
		if len(errs) > 0 {
			for _, err := range errs {
				ce := *pos
				ce.Object = key.String()
				ce.Detail = err.Error()
				if fe, ok := err.(*proxy.FieldError); ok {
					ce.Field, ce.Detail = fe.Field, fe.Detail
				}
				res.addErr(&ce)
			}
			if track(key) {
				res.failed = append(res.failed, key)
			}
			return
		}
		if first, dup := seen[key]; dup {
			d.duplicate(res, track, pos, key, first)
			return
		}
		seen[key] = e.pos
		res.objects = append(res.objects, e)
	default:
		res.skippedCount++
		if len(res.skipped) < maxErrorsKept {
			res.skipped = append(res.skipped, skippedDoc{where: pos.Where(), apiVersion: head.APIVersion, kind: head.Kind, name: meta.Name})
		}
	}
}

// decodeList decodes the items of a v1 List, ServiceList or EndpointSliceList. Items of typed
// lists may leave out apiVersion and kind.
func (d *decoder) decodeList(res *fileResult, seen map[objKey]docPos, track func(objKey) bool, pos *DocError, apiVersion, kind string, fields map[string]json.RawMessage) {
	listErr := func(field, format string, args ...any) {
		e := *pos
		e.Field = field
		e.Detail = fmt.Sprintf(format, args...)
		res.addErr(&e)
		res.unidentified = true
	}
	itemVersion, itemKind := "", ""
	switch kind {
	case kindList, kindServiceList:
		if apiVersion != coreV1 {
			listErr("apiVersion", "%q is not supported for a %s, want %q", apiVersion, kind, coreV1)
			return
		}
		if kind == kindServiceList {
			itemVersion, itemKind = coreV1, kindService
		}
	case kindEndpointSliceList:
		if apiVersion != discoveryV1 {
			listErr("apiVersion", "%q is not supported for an EndpointSliceList, want %q", apiVersion, discoveryV1)
			return
		}
		itemVersion, itemKind = discoveryV1, kindEndpointSlice
	}
	for _, name := range slices.Sorted(maps.Keys(fields)) { // sorted: the same errors in the same order every time
		switch name {
		case "apiVersion", "kind", "metadata", "items":
		default:
			// Reported, but the items are still served: nothing of ours is lost.
			e := *pos
			e.Field = name
			e.Detail = "unknown field in " + kind
			res.addErr(&e)
		}
	}
	var items []json.RawMessage
	if raw, ok := fields["items"]; ok && !bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		if err := json.Unmarshal(raw, &items); err != nil {
			listErr("items", "not a list of objects")
			return
		}
	}
	for i, item := range items {
		ipos := *pos
		ipos.Item = i
		if itemKind != "" {
			var m map[string]any
			if json.Unmarshal(item, &m) == nil && m != nil {
				if _, ok := m["kind"]; !ok {
					m["kind"] = itemKind
					if _, ok := m["apiVersion"]; !ok {
						m["apiVersion"] = itemVersion
					}
					if b, err := json.Marshal(m); err == nil {
						item = b
					}
				}
			}
		}
		d.decodeDocument(res, seen, track, &ipos, item, nil, false)
	}
}

// toJSON converts one document to JSON. A document that looks like JSON is used as it is (the
// strict JSON decoder reports its duplicate fields); YAML is converted strictly, and when only
// the strict conversion fails (a duplicate key) its error is returned as strictErr along with
// the leniently converted JSON, so that the object can still be identified.
func toJSON(data []byte) (js []byte, strictErr, err error) {
	trimmed := bytes.TrimSpace(data)
	if len(trimmed) > 0 && (trimmed[0] == '{' || trimmed[0] == '[') {
		if json.Valid(trimmed) {
			return trimmed, nil, nil
		}
		var v any
		if err := json.Unmarshal(trimmed, &v); err != nil {
			var se *json.SyntaxError
			if errors.As(err, &se) {
				lead := len(data) - len(bytes.TrimLeft(data, " \t\r\n"))
				line := 1 + bytes.Count(data[:min(lead+int(se.Offset), len(data))], []byte("\n"))
				return nil, nil, fmt.Errorf("JSON syntax error near line %d: %w", line, err)
			}
			if !errors.As(err, new(*json.UnmarshalTypeError)) {
				return nil, nil, fmt.Errorf("JSON: %w", err)
			}
		}
		return trimmed, nil, nil
	}
	if line := secondDocument(data); line > 0 {
		return nil, nil, fmt.Errorf("line %d: a second YAML document starts here, which would be ignored; start each document after a line holding only \"---\"", line)
	}
	js, strictErr = yaml.YAMLToJSONStrict(data)
	if strictErr == nil {
		return js, nil, nil
	}
	js, err = yaml.YAMLToJSON(data)
	if err != nil {
		return nil, nil, err
	}
	return js, strictErr, nil
}

var (
	reUnknownField = regexp.MustCompile(`(?:unknown|duplicate) field "([^"]+)"`)
	reTypeField    = regexp.MustCompile(`Go struct field [A-Za-z0-9_]+\.(\S+) of type`)
	reYAMLLine     = regexp.MustCompile(`\bline (\d+)\b`)
)

// errorField extracts the field(s) a decoding error is about, "" when it names none.
func errorField(msg string) string {
	var out []string
	for _, m := range reUnknownField.FindAllStringSubmatch(msg, -1) {
		out = append(out, m[1])
	}
	for _, m := range reTypeField.FindAllStringSubmatch(msg, -1) {
		out = append(out, m[1])
	}
	return strings.Join(out, ", ")
}

// fileLines rewrites "line N" in a YAML error about a document starting at line start of its
// file into the line of the file.
func fileLines(msg string, start int) string {
	if start <= 1 {
		return msg
	}
	return reYAMLLine.ReplaceAllStringFunc(msg, func(s string) string {
		n, err := strconv.Atoi(s[len("line "):])
		if err != nil {
			return s
		}
		return "line " + strconv.Itoa(n+start-1)
	})
}
