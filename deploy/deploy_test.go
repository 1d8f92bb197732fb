package deploy

import (
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/app"
)

// TestManifests checks what the API server's dry run cannot: the ConfigMap's configuration is
// one the proxy accepts, and the DaemonSet keeps the properties the README promises.
func TestManifests(t *testing.T) {
	objs, err := Objects()
	if err != nil {
		t.Fatal(err)
	}
	byKind := map[string]*unstructured.Unstructured{}
	for _, o := range objs {
		byKind[o.GetKind()] = o
	}
	cfg, _, _ := unstructured.NestedString(byKind["ConfigMap"].Object, "data", "config.yaml")
	kp, err := app.DecodeConfig([]byte(cfg))
	if err != nil {
		t.Fatalf("ConfigMap config.yaml: %v", err)
	}
	o := app.NewOptions()
	if _, err := o.ApplyConfig(kp, func(string) bool { return false }); err != nil {
		t.Fatalf("ConfigMap config.yaml: %v", err)
	}
	o.HostnameOverride = "node"
	if _, err := o.Validate(); err != nil {
		t.Fatalf("ConfigMap config.yaml: %v", err)
	}

	ds := byKind["DaemonSet"].Object
	spec := func(path ...string) any {
		v, _, _ := unstructured.NestedFieldNoCopy(ds, append([]string{"spec", "template", "spec"}, path...)...)
		return v
	}
	if spec("hostNetwork") != true {
		t.Error("DaemonSet: hostNetwork is not true")
	}
	containers := spec("containers").([]any)
	c := containers[0].(map[string]any)
	checks := []struct {
		name string
		path []string
		want any
	}{
		{"not privileged", []string{"securityContext", "privileged"}, false},
		{"liveness path", []string{"livenessProbe", "httpGet", "path"}, "/livez"},
		{"liveness port", []string{"livenessProbe", "httpGet", "port"}, float64(10256)},
		{"readiness path", []string{"readinessProbe", "httpGet", "path"}, "/healthz"},
		{"readiness port", []string{"readinessProbe", "httpGet", "port"}, float64(10256)},
	}
	for _, ck := range checks {
		got, _, _ := unstructured.NestedFieldNoCopy(c, ck.path...)
		if got != ck.want {
			t.Errorf("DaemonSet %s: %v = %#v, want %#v", ck.name, ck.path, got, ck.want)
		}
	}
	caps, _, _ := unstructured.NestedStringSlice(c, "securityContext", "capabilities", "add")
	if len(caps) != 2 || caps[0] != "NET_ADMIN" || caps[1] != "NET_RAW" {
		t.Errorf("DaemonSet capabilities = %v, want [NET_ADMIN NET_RAW]", caps)
	}
	mounts := map[string]bool{}
	for _, m := range c["volumeMounts"].([]any) {
		mm := m.(map[string]any)
		mounts[mm["mountPath"].(string)] = mm["readOnly"] == true
	}
	if ro, ok := mounts["/lib/modules"]; !ok || !ro {
		t.Error("DaemonSet: /lib/modules not mounted read-only")
	}
	if _, ok := mounts["/run/xtables.lock"]; !ok {
		t.Error("DaemonSet: /run/xtables.lock not mounted")
	}
}
