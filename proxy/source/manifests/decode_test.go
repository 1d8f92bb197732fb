package manifests

import (
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

const svcA = `apiVersion: v1
kind: Service
metadata:
  name: a
spec:
  ports:
  - port: 80
`

const sliceA = `apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: a-1
  labels: {kubernetes.io/service-name: a}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [10.0.0.1]}]
`

// trackAll asks decodeFile to list every failed object.
func trackAll(objKey) bool { return true }

func keys(es []*entry) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.key.String())
	}
	return out
}

func keyStrings(ks []objKey) []string {
	var out []string
	for _, k := range ks {
		out = append(out, k.String())
	}
	return out
}

func TestDecodeFile(t *testing.T) {
	tests := []struct {
		name         string
		json         bool
		data         string
		wantObjects  []string
		wantFailed   []string
		unidentified bool
		wantSkipped  int
		// wantErrs are substrings, one per expected error, in order.
		wantErrs []string
	}{
		{name: "single document", data: svcA, wantObjects: []string{"Service default/a"}},
		{name: "multi-document with separators and comments", data: "# header\n---\n" + svcA + "--- # next\n" + sliceA + "---\n---\n# only a comment\n",
			wantObjects: []string{"Service default/a", "EndpointSlice default/a-1"}},
		{name: "namespace kept", data: strings.Replace(svcA, "  name: a\n", "  name: a\n  namespace: prod\n", 1), wantObjects: []string{"Service prod/a"}},
		{name: "JSON object", json: true, data: `{"apiVersion":"v1","kind":"Service","metadata":{"name":"j"},"spec":{"ports":[{"port":1}]}}`,
			wantObjects: []string{"Service default/j"}},
		{name: "JSON v1 List", json: true, data: `{"apiVersion":"v1","kind":"List","items":[
			{"apiVersion":"v1","kind":"Service","metadata":{"name":"j"},"spec":{"ports":[{"port":1}]}},
			{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"d"}},
			{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{"name":"j-1","labels":{"kubernetes.io/service-name":"j"}},"addressType":"IPv4"}]}`,
			wantObjects: []string{"Service default/j", "EndpointSlice default/j-1"}, wantSkipped: 1},
		{name: "ServiceList items without kind", data: "apiVersion: v1\nkind: ServiceList\nitems:\n- metadata: {name: x}\n  spec: {ports: [{port: 1}]}\n",
			wantObjects: []string{"Service default/x"}},
		{name: "EndpointSliceList", data: "apiVersion: discovery.k8s.io/v1\nkind: EndpointSliceList\nitems:\n- metadata: {name: x-1, labels: {kubernetes.io/service-name: x}}\n  addressType: IPv6\n",
			wantObjects: []string{"EndpointSlice default/x-1"}},
		{name: "empty file", data: ""},
		{name: "empty JSON file", json: true, data: "\n"},
		{name: "only comments", data: "# nothing\n---\n# here\n"},
		{name: "other kind ignored", data: "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec: {replicas: 1}\n", wantSkipped: 1},
		{name: "unknown field", data: svcA + "    bogus: 1\n", wantFailed: []string{"Service default/a"},
			wantErrs: []string{`document 1 (line 1): Service default/a: spec.ports[0].bogus: strict decoding error: unknown field "spec.ports[0].bogus"`}},
		{name: "unknown field in second document names its line", data: sliceA + "---\n" + strings.Replace(svcA, "spec:", "spec:\n  colour: blue", 1),
			wantObjects: []string{"EndpointSlice default/a-1"}, wantFailed: []string{"Service default/a"},
			wantErrs: []string{`document 2 (line 10): Service default/a: spec.colour: `}},
		{name: "mistyped field", data: strings.Replace(svcA, "port: 80", "port: eighty", 1), wantFailed: []string{"Service default/a"},
			wantErrs: []string{"Service default/a: spec.ports.port: json: cannot unmarshal string"}},
		{name: "duplicate field", data: strings.Replace(svcA, "  name: a\n", "  name: a\n  name: a\n", 1), wantFailed: []string{"Service default/a"},
			wantErrs: []string{`line 5: key "name" already set`}},
		{name: "YAML syntax error, line in file", data: svcA + "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: [b\n", wantObjects: []string{"Service default/a"}, unidentified: true,
			wantErrs: []string{"document 2 (line 9): yaml: line 12: "}},
		{name: "JSON syntax error", json: true, data: "\n{\"apiVersion\":\"v1\",\n\"kind\": Service}", unidentified: true, wantErrs: []string{"document 1 (line 1): JSON syntax error near line 3: invalid character 'S'"}},
		{name: "JSON duplicate field", json: true, data: `{"apiVersion":"v1","kind":"Service","metadata":{"name":"j","name":"k"},"spec":{"ports":[{"port":1}]}}`,
			wantFailed: []string{"Service default/k"}, wantErrs: []string{`Service default/k: metadata.name: strict decoding error: duplicate field "metadata.name"`}},
		{name: "not a mapping", data: "- a\n- b\n", unidentified: true, wantErrs: []string{"not a mapping"}},
		{name: "missing kind", data: "apiVersion: v1\nmetadata: {name: a}\n", unidentified: true, wantErrs: []string{"kind: missing"}},
		{name: "missing name", data: "apiVersion: v1\nkind: Service\nspec: {ports: [{port: 1}]}\n", unidentified: true, wantErrs: []string{"metadata.name: missing"}},
		{name: "wrong apiVersion for EndpointSlice", data: strings.Replace(sliceA, "discovery.k8s.io/v1", "discovery.k8s.io/v1beta1", 1),
			wantFailed: []string{"EndpointSlice default/a-1"}, wantErrs: []string{`apiVersion: "discovery.k8s.io/v1beta1" is not supported`}},
		{name: "nested List", json: true, data: `{"apiVersion":"v1","kind":"List","items":[{"apiVersion":"v1","kind":"List","items":[]}]}`,
			unidentified: true, wantErrs: []string{"items[0]: kind: a List inside a List"}},
		{name: "List with unknown field still serves its items", json: true, data: `{"apiVersion":"v1","kind":"List","itemz":[],"items":[{"apiVersion":"v1","kind":"Service","metadata":{"name":"j"},"spec":{"ports":[{"port":1}]}}]}`,
			wantObjects: []string{"Service default/j"}, wantErrs: []string{"itemz: unknown field in List"}},
		{name: "unknown field in List item", json: true, data: `{"apiVersion":"v1","kind":"List","items":[{"apiVersion":"v1","kind":"Service","metadata":{"name":"j"},"spec":{"portz":[]}}]}`,
			wantFailed: []string{"Service default/j"}, wantErrs: []string{`document 1 (line 1) items[0]: Service default/j: spec.portz`}},
		{name: "duplicate object in one file", data: svcA + "---\n" + strings.Replace(svcA, "80", "81", 1), wantObjects: []string{"Service default/a"},
			wantFailed: []string{"Service default/a"}, wantErrs: []string{"document 2 (line 9): Service default/a: metadata.name: Service default/a is defined again (first in document 1 (line 1))"}},
		{name: "port out of range", data: strings.Replace(svcA, "80", "70000", 1), wantFailed: []string{"Service default/a"},
			wantErrs: []string{"Service default/a: spec.ports[0].port: 70000 out of range 1..65535"}},
		{name: "bad protocol", data: svcA + "    protocol: ICMP\n", wantFailed: []string{"Service default/a"}, wantErrs: []string{`spec.ports[0].protocol: unsupported value "ICMP"`}},
		{name: "two ports without names", data: svcA + "  - port: 81\n", wantFailed: []string{"Service default/a"},
			wantErrs: []string{"spec.ports[0].name: required", "spec.ports[1].name: required"}},
		{name: "duplicate port", data: svcA + "    name: p\n  - port: 80\n    name: q\n", wantFailed: []string{"Service default/a"}, wantErrs: []string{"spec.ports[1]: duplicate port 80/TCP"}},
		{name: "invalid service name", data: strings.Replace(svcA, "name: a", "name: A_b", 1), wantFailed: []string{"Service default/A_b"}, wantErrs: []string{"metadata.name"}},
		{name: "invalid cluster IP", data: strings.Replace(svcA, "spec:\n", "spec:\n  clusterIP: 10.0.0.300\n", 1), wantFailed: []string{"Service default/a"}, wantErrs: []string{"spec.clusterIPs[0]: invalid IP"}},
		{name: "clusterIP and clusterIPs disagree", data: strings.Replace(svcA, "spec:\n", "spec:\n  clusterIP: 10.96.0.5\n  clusterIPs: [10.96.0.6]\n", 1), wantFailed: []string{"Service default/a"}, wantErrs: []string{"spec.clusterIPs[0]"}},
		{name: "affinity timeout out of range", data: strings.Replace(svcA, "spec:\n", "spec:\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}\n", 1),
			wantFailed: []string{"Service default/a"}, wantErrs: []string{"timeoutSeconds: 0 out of range"}},
		{name: "no ports", data: "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {}\n", wantFailed: []string{"Service default/a"}, wantErrs: []string{"spec.ports: at least one port"}},
		{name: "headless without ports is fine", data: "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {clusterIP: None}\n", wantObjects: []string{"Service default/a"}},
		{name: "slice without service-name label", data: strings.Replace(sliceA, "  labels: {kubernetes.io/service-name: a}\n", "", 1), wantFailed: []string{"EndpointSlice default/a-1"},
			wantErrs: []string{"EndpointSlice default/a-1: metadata.labels[kubernetes.io/service-name]: missing"}},
		{name: "slice without addressType", data: strings.Replace(sliceA, "addressType: IPv4\n", "", 1), wantFailed: []string{"EndpointSlice default/a-1"}, wantErrs: []string{"addressType: missing"}},
		{name: "slice port out of range", data: strings.Replace(sliceA, "8080", "0", 1), wantFailed: []string{"EndpointSlice default/a-1"}, wantErrs: []string{"ports[0].port: 0 out of range"}},
		{name: "slice address of wrong family", data: strings.Replace(sliceA, "10.0.0.1", "fd00::1", 1), wantFailed: []string{"EndpointSlice default/a-1"}, wantErrs: []string{`endpoints[0].addresses[0]: "fd00::1" is not an IPv4 address`}},
		{name: "second document after an end marker", data: svcA + "...\n" + strings.Replace(svcA, "name: a", "name: b", 1), unidentified: true,
			wantErrs: []string{"document 1 (line 1): line 9: a second YAML document starts here"}},
		{name: "second document on its separator line", data: "# c\n---\n" + svcA + "--- {kind: Service}\n", unidentified: true,
			wantErrs: []string{"document 1 (line 3): line 10: a second YAML document starts here"}},
		{name: "end marker followed by comments only", data: svcA + "...\n# the end\n...\n", wantObjects: []string{"Service default/a"}},
		{name: "first document on its start marker", data: "--- {apiVersion: v1, kind: Service, metadata: {name: a}, spec: {ports: [{port: 1}]}}\n",
			wantObjects: []string{"Service default/a"}},
		{name: "JSON file holding YAML documents", json: true, data: svcA + "---\n" + strings.Replace(svcA, "name: a", "name: b", 1), unidentified: true,
			wantErrs: []string{"document 1 (line 1): line 8: a second YAML document starts here"}},
		// Found by FuzzDecode: valid for the source, rejected by the model.
		{name: "external IP with a zone", data: strings.Replace(svcA, "spec:\n", "spec:\n  externalIPs: ['fe80::1%eth0']\n", 1), wantFailed: []string{"Service default/a"},
			wantErrs: []string{`spec.externalIPs[0]: invalid IP "fe80::1%eth0"`}},
		{name: "load balancer ingress IP invalid", data: svcA + "status: {loadBalancer: {ingress: [{ip: 10.0.0.1}, {ip: nope, ipMode: Tunnel}]}}\n", wantFailed: []string{"Service default/a"},
			wantErrs: []string{`status.loadBalancer.ingress[1].ip: invalid IP "nope"`, `status.loadBalancer.ingress[1].ipMode: unsupported value "Tunnel"`}},
		{name: "unknown trafficDistribution", data: strings.Replace(svcA, "spec:\n", "spec:\n  trafficDistribution: Anywhere\n", 1), wantFailed: []string{"Service default/a"},
			wantErrs: []string{`spec.trafficDistribution: unsupported value "Anywhere"`}},
		{name: "invalid PROXY protocol annotation", data: strings.Replace(svcA, "  name: a\n", "  name: a\n  annotations: {kube-userspace-proxy.io/proxy-protocol: v3}\n", 1), wantFailed: []string{"Service default/a"},
			wantErrs: []string{`metadata.annotations[kube-userspace-proxy.io/proxy-protocol]: invalid value "v3"`}},
		{name: "slice hints with invalid names", data: strings.Replace(sliceA, "[{addresses: [10.0.0.1]}]", "[{addresses: [10.0.0.1], hints: {forZones: [{name: 'a b'}], forNodes: [{name: N_1}]}}]", 1),
			wantFailed: []string{"EndpointSlice default/a-1"}, wantErrs: []string{`endpoints[0].hints.forZones[0].name: invalid zone name "a b"`, `endpoints[0].hints.forNodes[0].name: invalid node name "N_1"`}},
		{name: "slice endpoint without addresses", data: strings.Replace(sliceA, "[10.0.0.1]", "[]", 1), wantFailed: []string{"EndpointSlice default/a-1"}, wantErrs: []string{"endpoints[0].addresses: must hold 1..100"}},
	}
	d := newDecoder()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			res := d.decodeFile("/m/f.yaml", tc.json, []byte(tc.data), trackAll)
			if got := keys(res.objects); !slices.Equal(got, tc.wantObjects) {
				t.Errorf("objects %q, want %q", got, tc.wantObjects)
			}
			if got := keyStrings(res.failed); !slices.Equal(got, tc.wantFailed) {
				t.Errorf("failed %q, want %q", got, tc.wantFailed)
			}
			if res.unidentified != tc.unidentified {
				t.Errorf("unidentified %v, want %v", res.unidentified, tc.unidentified)
			}
			if len(res.skipped) != tc.wantSkipped {
				t.Errorf("%d skipped, want %d", len(res.skipped), tc.wantSkipped)
			}
			if len(res.errs) != len(tc.wantErrs) {
				t.Fatalf("errors %v, want %d matching %q", res.errs, len(tc.wantErrs), tc.wantErrs)
			}
			for i, e := range res.errs {
				if !strings.HasPrefix(e.Error(), "/m/f.yaml: ") || !strings.Contains(e.Error(), tc.wantErrs[i]) {
					t.Errorf("error %d %q, want one naming the file and containing %q", i, e.Error(), tc.wantErrs[i])
				}
			}
		})
	}
}

func TestServiceDefaults(t *testing.T) {
	data := `apiVersion: v1
kind: Service
metadata: {name: s}
spec:
  type: NodePort
  sessionAffinity: ClientIP
  ports:
  - {name: a, port: 80}
  - {name: b, port: 53, protocol: UDP, targetPort: dns}
---
apiVersion: v1
kind: Service
metadata: {name: lb}
spec:
  type: LoadBalancer
  clusterIPs: [10.96.5.5]
  ports: [{port: 1}]
---
apiVersion: v1
kind: Service
metadata: {name: plain}
spec:
  ports: [{port: 1}]
`
	res := newDecoder().decodeFile("f.yaml", false, []byte(data), trackAll)
	if len(res.errs) != 0 || len(res.objects) != 3 {
		t.Fatalf("errors %v, objects %v", res.errs, keys(res.objects))
	}
	s, lb, plain := res.objects[0].svc, res.objects[1].svc, res.objects[2].svc
	checks := []struct {
		name      string
		got, want any
	}{
		{"namespace", s.Namespace, "default"},
		{"port a protocol", s.Spec.Ports[0].Protocol, v1.ProtocolTCP},
		{"port a targetPort", s.Spec.Ports[0].TargetPort, intstr.FromInt32(80)},
		{"port b targetPort kept", s.Spec.Ports[1].TargetPort, intstr.FromString("dns")},
		{"affinity timeout", *s.Spec.SessionAffinityConfig.ClientIP.TimeoutSeconds, int32(10800)},
		{"externalTrafficPolicy", s.Spec.ExternalTrafficPolicy, v1.ServiceExternalTrafficPolicyCluster},
		{"internalTrafficPolicy", *s.Spec.InternalTrafficPolicy, v1.ServiceInternalTrafficPolicyCluster},
		{"lb clusterIP from clusterIPs", lb.Spec.ClusterIP, "10.96.5.5"},
		{"lb allocateLoadBalancerNodePorts", *lb.Spec.AllocateLoadBalancerNodePorts, true},
		{"plain type", plain.Spec.Type, v1.ServiceTypeClusterIP},
		{"plain sessionAffinity", plain.Spec.SessionAffinity, v1.ServiceAffinityNone},
		{"plain externalTrafficPolicy", plain.Spec.ExternalTrafficPolicy, v1.ServiceExternalTrafficPolicy("")},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
}

func TestSplitDocuments(t *testing.T) {
	tests := []struct {
		name      string
		in        string
		wantLines []int
	}{
		{"none", "", nil},
		{"one", "a: 1\n", []int{1}},
		{"leading separator", "---\na: 1\n", []int{2}},
		{"two", "a: 1\n---\nb: 2\n", []int{1, 3}},
		{"separator with comment and blanks", "a: 1\n---   # x\n\nb: 2", []int{1, 3}},
		{"not a separator", "a: |\n  ---\nb: 2\n----\n", []int{1}},
		{"empty documents dropped", "---\n---\n# c\n---\na: 1\n...\n", []int{5}},
		{"CRLF", "a: 1\r\n---\r\nb: 2\r\n", []int{1, 3}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var got []int
			for _, d := range splitDocuments([]byte(tc.in)) {
				got = append(got, d.line)
			}
			if !slices.Equal(got, tc.wantLines) {
				t.Errorf("documents start at lines %v, want %v", got, tc.wantLines)
			}
		})
	}
}

func TestIsManifestFile(t *testing.T) {
	tests := map[string]bool{
		"a.yaml": true, "a.yml": true, "a.json": true, "A.YAML": true,
		".a.yaml": false, "..data": false, "#a.yaml#": false, "a.yaml~": false, "a.yaml.swp": false,
		"~a.yaml": false, "a.txt": false, "a": false, "yaml": false, "a.yaml.bak": false, "a.json.tmp": false,
	}
	for name, want := range tests {
		if got := isManifestFile(name); got != want {
			t.Errorf("isManifestFile(%q) = %v, want %v", name, got, want)
		}
	}
}

// splitDocuments returns all the documents of a YAML stream (see documents).
func splitDocuments(data []byte) []document {
	return slices.Collect(documents(data))
}

// decodeFile decodes the content of one manifest file, sequentially and without a cache (see
// decodeFiles for the parallel form the source uses). JSON files (by name) hold one object or
// List; YAML files hold any number of documents, decoded one at a time. It never panics: a panic
// in a decoding library is turned into an error for that document. Of the objects whose document
// fails, only those for which track returns true are listed in failed (the objects of the file's
// previous content: only those can be kept), so that a file of many broken documents costs no
// more memory than its content and maxErrorsKept errors.
func (d *decoder) decodeFile(path string, isJSON bool, data []byte, track func(objKey) bool) *fileResult {
	return d.decodeFiles([]*fileJob{{path: path, isJSON: isJSON, data: data, track: track}}, 1)[0]
}
