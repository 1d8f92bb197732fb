package manifests

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"sigs.k8s.io/yaml"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/serviceport"
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

// String returns "Kind namespace/name", the form used in logs and serviceport.FieldError.
func (k objKey) String() string { return k.Kind + " " + k.Namespace + "/" + k.Name }

// entry is one decoded, defaulted and validated object of one file.
type entry struct {
	key   objKey
	svc   *v1.Service              // set for kind Service
	slice *discovery.EndpointSlice // set for kind EndpointSlice
	where string                   // "document 2 (line 14)" or "document 1 (line 1) items[3]"
	// stale is true when the object is the last good version kept from an earlier content of
	// the file, because the current content failed to decode where the object may be.
	stale bool
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

// fileResult is what decoding one file's content produced.
type fileResult struct {
	objects []*entry
	// failed lists the objects whose document was identified but failed; their last good
	// versions keep serving.
	failed []objKey
	// unidentified is true when some document failed before its object could be identified;
	// then every object of the file's previous content that is not in objects keeps serving.
	unidentified bool
	errs         []*DocError
	skipped      []skippedDoc
}

// skippedDoc is a document of a kind this source does not serve.
type skippedDoc struct {
	where, apiVersion, kind, name string
}

// decoder decodes manifests into the k8s.io/api types, strictly: unknown, duplicate and
// mistyped fields are errors.
type decoder struct {
	codec runtime.Decoder
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

// splitDocuments splits a YAML stream at lines that start with "---" followed only by blanks or
// a comment, the way kubectl does. Documents holding nothing but blanks and comments are dropped.
func splitDocuments(data []byte) []document {
	var docs []document
	start, startLine, line := 0, 1, 1
	flush := func(end int) {
		if d := data[start:end]; !blank(d) {
			docs = append(docs, document{data: d, line: startLine})
		}
	}
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
			flush(pos)
			start, startLine = next, line+1
		}
		pos = next
	}
	flush(len(data))
	return docs
}

func isSeparator(line []byte) bool {
	if !bytes.HasPrefix(line, []byte("---")) {
		return false
	}
	rest := bytes.TrimSpace(line[3:])
	return len(rest) == 0 || rest[0] == '#'
}

// blank reports whether a YAML document holds only blanks, comments and a "..." end marker.
func blank(d []byte) bool {
	for _, l := range bytes.Split(d, []byte("\n")) {
		l = bytes.TrimSpace(l)
		if len(l) != 0 && l[0] != '#' && !bytes.Equal(l, []byte("...")) {
			return false
		}
	}
	return true
}

// decodeFile decodes the content of one manifest file. JSON files (by name) hold one object or
// List; YAML files hold any number of documents. It never panics: a panic in a decoding library
// is turned into an error for that document.
func (d *decoder) decodeFile(path string, isJSON bool, data []byte) *fileResult {
	res := &fileResult{}
	if len(data) > maxFileSize {
		res.unidentified = true
		res.errs = append(res.errs, &DocError{File: path, Item: -1, Detail: fmt.Sprintf("file is larger than %d bytes", maxFileSize)})
		return res
	}
	var docs []document
	if isJSON {
		if len(bytes.TrimSpace(data)) != 0 {
			docs = []document{{data: data, line: 1}}
		}
	} else {
		docs = splitDocuments(data)
	}
	seen := map[objKey]string{}
	for i, doc := range docs {
		d.decodeDocument(res, seen, &DocError{File: path, Doc: i + 1, Line: doc.line, Item: -1}, doc.data, true)
	}
	return res
}

// decodeDocument decodes one document, or one List item when top is false. pos carries the
// position for errors.
func (d *decoder) decodeDocument(res *fileResult, seen map[objKey]string, pos *DocError, data []byte, top bool) {
	fail := func(key *objKey, field, format string, args ...any) {
		e := *pos
		e.Field = field
		e.Detail = fmt.Sprintf(format, args...)
		if key != nil {
			e.Object = key.String()
			res.failed = append(res.failed, *key)
		} else {
			res.unidentified = true
		}
		res.errs = append(res.errs, &e)
	}
	defer func() {
		if r := recover(); r != nil {
			fail(nil, "", "internal error: panic while decoding: %v", r)
		}
	}()

	js, strictErr, err := toJSON(data)
	if err != nil {
		fail(nil, "", "%s", fileLines(err.Error(), pos.Line))
		return
	}
	if bytes.Equal(bytes.TrimSpace(js), []byte("null")) {
		return // an empty document
	}
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(js, &fields); err != nil {
		fail(nil, "", "document is not a mapping of fields")
		return
	}
	// Lenient look at the identity, so that a document failing strict decoding is still known.
	_ = json.Unmarshal(js, &head)
	var meta struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	}
	_ = json.Unmarshal(fields["metadata"], &meta)
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
		d.decodeList(res, seen, pos, head.APIVersion, head.Kind, fields)
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
		e := &entry{key: key, where: pos.Where()}
		var errs []error
		switch o := obj.(type) {
		case *v1.Service:
			errs = defaultAndValidateService(o)
			e.svc = o
		case *discovery.EndpointSlice:
			errs = defaultAndValidateSlice(o)
			e.slice = o
		default:
			fail(keyp, "", "decoded into unexpected type %T", obj)
			return
		}
		if len(errs) > 0 {
			for _, err := range errs {
				ce := *pos
				ce.Object = key.String()
				ce.Detail = err.Error()
				if fe, ok := err.(*serviceport.FieldError); ok {
					ce.Field, ce.Detail = fe.Field, fe.Detail
				}
				res.errs = append(res.errs, &ce)
			}
			res.failed = append(res.failed, key)
			return
		}
		if first, dup := seen[key]; dup {
			fail(keyp, "metadata.name", "%s is defined again (first in %s); this one is ignored", key, first)
			return
		}
		seen[key] = e.where
		res.objects = append(res.objects, e)
	default:
		res.skipped = append(res.skipped, skippedDoc{where: pos.Where(), apiVersion: head.APIVersion, kind: head.Kind, name: meta.Name})
	}
}

// decodeList decodes the items of a v1 List, ServiceList or EndpointSliceList. Items of typed
// lists may leave out apiVersion and kind.
func (d *decoder) decodeList(res *fileResult, seen map[objKey]string, pos *DocError, apiVersion, kind string, fields map[string]json.RawMessage) {
	listErr := func(field, format string, args ...any) {
		e := *pos
		e.Field = field
		e.Detail = fmt.Sprintf(format, args...)
		res.errs = append(res.errs, &e)
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
	for name := range fields {
		switch name {
		case "apiVersion", "kind", "metadata", "items":
		default:
			// Reported, but the items are still served: nothing of ours is lost.
			e := *pos
			e.Field = name
			e.Detail = "unknown field in " + kind
			res.errs = append(res.errs, &e)
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
		d.decodeDocument(res, seen, &ipos, item, false)
	}
}

// toJSON converts one document to JSON. A document that looks like JSON is used as it is (the
// strict JSON decoder reports its duplicate fields); YAML is converted strictly, and when only
// the strict conversion fails (a duplicate key) its error is returned as strictErr along with
// the leniently converted JSON, so that the object can still be identified.
func toJSON(data []byte) (js []byte, strictErr, err error) {
	trimmed := bytes.TrimSpace(data)
	if len(trimmed) > 0 && (trimmed[0] == '{' || trimmed[0] == '[') {
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
