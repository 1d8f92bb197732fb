package manifests

import (
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
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
		// Valid for the source, but is it for the model?
		"apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {externalIPs: ['fe80::1%eth0'], ports: [{port: 1}]}\n",
		"apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {type: LoadBalancer, ports: [{port: 1}]}\nstatus: {loadBalancer: {ingress: [{ip: 'not an IP'}]}}\n",
		"apiVersion: v1\nkind: Service\nmetadata: {name: a, annotations: {kube-userspace-proxy.io/proxy-protocol: v3}}\nspec: {ports: [{port: 1}]}\n",
		"apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {trafficDistribution: Anywhere, ports: [{port: 1}]}\n",
		"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: a-1, labels: {kubernetes.io/service-name: a}}\naddressType: IPv6\nports: [{port: 1}]\n" +
			"endpoints: [{addresses: ['fe80::1%eth0']}]\n",
		"apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: a-1, labels: {kubernetes.io/service-name: a}}\naddressType: IPv6\nports: [{port: 1}]\n" +
			"endpoints: [{addresses: ['fd00::1'], hints: {forZones: [{name: 'a b'}], forNodes: [{name: 'N_1'}]}}]\n",
	} {
		f.Add([]byte(seed), false)
	}
	f.Add([]byte(`{"apiVersion":"v1","kind":"List","items":[{"kind":"Service","apiVersion":"v1","metadata":{"name":"x"}}]}`), true)
	f.Add([]byte(`{"apiVersion":"v1",`), true)

	d := newDecoder()
	alloc, err := newAllocator([]netip.Prefix{DefaultServiceCIDR, netip.MustParsePrefix("fd00::/108")})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte, isJSON bool) {
		res := d.decodeFile("/fuzz/f.yaml", isJSON, data, trackAll)
		seen := map[objKey]bool{}
		var svcs []*v1.Service
		slicesOf := map[types.NamespacedName][]*discovery.EndpointSlice{}
		for _, e := range res.objects {
			if (e.svc == nil) == (e.slice == nil) {
				t.Fatalf("entry %s holds %v and %v", e.key, e.svc, e.slice)
			}
			if e.key.Name == "" || e.key.Namespace == "" || seen[e.key] {
				t.Fatalf("bad or duplicate key %q", e.key)
			}
			seen[e.key] = true
			if e.svc != nil {
				if e.key != (objKey{kindService, e.svc.Namespace, e.svc.Name}) {
					t.Fatalf("key %s for Service %s/%s", e.key, e.svc.Namespace, e.svc.Name)
				}
				svcs = append(svcs, e.svc)
				continue
			}
			sl := e.slice.obj
			if e.key != (objKey{kindEndpointSlice, sl.Namespace, sl.Name}) {
				t.Fatalf("key %s for EndpointSlice %s/%s", e.key, sl.Namespace, sl.Name)
			}
			// What the source keeps decodes again into the same object (see sliceDoc).
			again, err := d.slice(&sliceDoc{pb: e.slice.pb})
			if err != nil || !equality.Semantic.DeepEqual(again, sl) {
				t.Fatalf("%s: the kept encoding decodes again into %+v, %v; want %+v", e.key, again, err, sl)
			}
			n, ok := proxy.SliceServiceName(sl)
			if !ok {
				t.Fatalf("%s: no service name, yet valid", e.key)
			}
			slicesOf[n] = append(slicesOf[n], sl)
		}
		// What the source delivers (validated, then allocated) the model takes without a word.
		done, _, _ := alloc.allocate(svcs, emptyAlloc())
		for _, svc := range done {
			if svc == nil {
				continue
			}
			sps, err := proxy.FromService(svc)
			if err != nil {
				t.Fatalf("the model rejects a Service the source delivers: %v", err)
			}
			for _, sp := range sps {
				if sp.Name.Namespace != svc.Namespace || sp.Name.Name != svc.Name || sp.Port < 1 || sp.Port > 65535 || len(sp.ClusterIPs) == 0 {
					t.Fatalf("ServicePort %s port %d cluster IPs %v from Service %s/%s", sp, sp.Port, sp.ClusterIPs, svc.Namespace, svc.Name)
				}
			}
		}
		for n, list := range slicesOf {
			if _, err := endpointsOf(list); err != nil {
				t.Fatalf("the model rejects the EndpointSlices the source delivers for %s: %v", n, err)
			}
		}

		if len(res.errs) > maxErrorsKept || res.errCount < len(res.errs) || (res.errCount > len(res.errs) && len(res.errs) < maxErrorsKept) {
			t.Fatalf("%d errors kept of %d", len(res.errs), res.errCount)
		}
		if len(res.skipped) > maxErrorsKept || res.skippedCount < len(res.skipped) || (res.skippedCount > len(res.skipped) && len(res.skipped) < maxErrorsKept) {
			t.Fatalf("%d ignored documents kept of %d", len(res.skipped), res.skippedCount)
		}
		for _, e := range res.errs {
			if e.File != "/fuzz/f.yaml" || e.Detail == "" || e.Doc < 0 || (e.Doc > 0 && e.Line < 1) {
				t.Fatalf("error without file, position or detail: %#v", e)
			}
			if e.Object != "" && !strings.HasPrefix(e.Object, kindService+" ") && !strings.HasPrefix(e.Object, kindEndpointSlice+" ") {
				t.Fatalf("error naming %q, not a Service or an EndpointSlice", e.Object)
			}
			if strings.Contains(e.Detail, "internal error: panic") {
				t.Fatalf("decoder panicked: %s", e.Detail)
			}
		}
		if res.errCount == 0 && (res.unidentified || len(res.failed) > 0) {
			t.Fatalf("failures without an error: %+v", res)
		}
		checkParallel(t, data, isJSON)
	})
}
