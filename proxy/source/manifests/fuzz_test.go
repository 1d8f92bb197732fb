package manifests

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/serviceport"
)

// FuzzDecode feeds arbitrary file content to the decoder. It must never panic (a panic inside
// a decoding library would surface as an "internal error" DocError, which fails the test too),
// and what it returns must be consistent and acceptable to the model.
func FuzzDecode(f *testing.F) {
	files, err := filepath.Glob("testdata/example/*")
	if err != nil {
		f.Fatal(err)
	}
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data, strings.HasSuffix(name, ".json"))
	}
	for _, seed := range []string{
		svcA, sliceA, svcA + "---\n" + sliceA,
		svcA + "    bogus: 1\n",
		"apiVersion: v1\nkind: Service\nmetadata:\n  name: [oops\n",
		"apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: List\n",
		"apiVersion: v1\nkind: ServiceList\nitems: [{metadata: {name: a}, spec: {ports: [{port: 70000}]}}]\n",
		"apiVersion: discovery.k8s.io/v1\nkind: EndpointSliceList\nitems: 3\n",
		"a: &a [*a, *a]\nb: *a\n",
		"- 1\n- 2\n", "null", "---\n---\n", "kind: 5\n", "metadata: {name: {x: 1}}\nkind: Service\napiVersion: v1\n",
		"apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIPs: [None, 10.0.0.1], ports: [{port: 1, targetPort: -1}]}\n",
	} {
		f.Add([]byte(seed), false)
	}
	f.Add([]byte(`{"apiVersion":"v1","kind":"List","items":[{"kind":"Service","apiVersion":"v1","metadata":{"name":"x"}}]}`), true)
	f.Add([]byte(`{"apiVersion":"v1",`), true)

	d := newDecoder()
	f.Fuzz(func(t *testing.T, data []byte, isJSON bool) {
		res := d.decodeFile("/fuzz/f.yaml", isJSON, data)
		seen := map[objKey]bool{}
		var slices []*discovery.EndpointSlice
		for _, e := range res.objects {
			if (e.svc == nil) == (e.slice == nil) {
				t.Fatalf("entry %s holds %v and %v", e.key, e.svc, e.slice)
			}
			if e.key.Name == "" || e.key.Namespace == "" || seen[e.key] {
				t.Fatalf("bad or duplicate key %q", e.key)
			}
			seen[e.key] = true
			if e.svc != nil {
				// The model must cope with whatever validated.
				_, _ = serviceport.FromService(e.svc)
			} else {
				slices = append(slices, e.slice)
			}
		}
		_, _ = serviceport.EndpointsFromSlices(types.NamespacedName{}, slices)
		for _, e := range res.errs {
			if e.File != "/fuzz/f.yaml" || e.Detail == "" {
				t.Fatalf("error without file or detail: %#v", e)
			}
			if strings.Contains(e.Detail, "internal error: panic") {
				t.Fatalf("decoder panicked: %s", e.Detail)
			}
		}
		if len(res.errs) == 0 && (res.unidentified || len(res.failed) > 0) {
			t.Fatalf("failures without an error: %+v", res)
		}
	})
}
