package deploy

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/tools/clientcmd"

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
	// hostNetwork turns every containerPort into a hostPort: the surge pod of a rolling update
	// would never fit beside the old one.
	if ports, ok := c["ports"]; ok {
		t.Errorf("DaemonSet: hostNetwork container has ports %v (each a hostPort: the rolling update's surge pod cannot be scheduled)", ports)
	}

	// The old pod of a rolling update serves on until the new one has taken over (its readiness
	// probe is answered by the old process: same port, same network namespace).
	if cmd, _, _ := unstructured.NestedStringSlice(c, "lifecycle", "preStop", "exec", "command"); len(cmd) != 2 || cmd[0] != "sleep" {
		t.Errorf("DaemonSet: preStop = %v, want a sleep before SIGTERM", cmd)
	}
	if grace, _ := spec("terminationGracePeriodSeconds").(float64); grace < 5+30 {
		t.Errorf("DaemonSet: terminationGracePeriodSeconds %v, want at least the preStop sleep plus --shutdown-grace-period", grace)
	}

	// The kubeconfig that names the API server: the configuration's clientConnection.kubeconfig
	// is the ConfigMap's kubeconfig.conf as mounted, and it parses.
	var cmMount string
	for _, m := range c["volumeMounts"].([]any) {
		mm := m.(map[string]any)
		if mm["name"] == "config" {
			cmMount = mm["mountPath"].(string)
		}
	}
	if want := cmMount + "/kubeconfig.conf"; o.Kubeconfig != want {
		t.Errorf("ConfigMap config.yaml: clientConnection.kubeconfig = %q, want %q (the ConfigMap's kubeconfig.conf as mounted)", o.Kubeconfig, want)
	}
	kc, _, _ := unstructured.NestedString(byKind["ConfigMap"].Object, "data", "kubeconfig.conf")
	kcfg, err := clientcmd.Load([]byte(kc))
	if err != nil {
		t.Fatalf("ConfigMap kubeconfig.conf: %v", err)
	}
	ctx := kcfg.Contexts[kcfg.CurrentContext]
	if ctx == nil || kcfg.Clusters[ctx.Cluster] == nil || kcfg.AuthInfos[ctx.AuthInfo] == nil {
		t.Fatalf("ConfigMap kubeconfig.conf: current context %q does not name a cluster and a user", kcfg.CurrentContext)
	}
	if cl := kcfg.Clusters[ctx.Cluster]; cl.Server == "" || cl.CertificateAuthority != "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt" {
		t.Errorf("ConfigMap kubeconfig.conf: cluster %+v: want a server and the ServiceAccount's CA", cl)
	}
	if u := kcfg.AuthInfos[ctx.AuthInfo]; u.TokenFile != "/var/run/secrets/kubernetes.io/serviceaccount/token" {
		t.Errorf("ConfigMap kubeconfig.conf: user's tokenFile = %q, want the ServiceAccount's token", u.TokenFile)
	}
}

// TestFilesAreObjects checks that kustomization.yaml, which is no API object, is not among the
// files applied one by one, and that it lists every one of them.
func TestFilesAreObjects(t *testing.T) {
	files := Files()
	data, err := manifests.ReadFile(kustomization)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if f == kustomization {
			t.Errorf("Files() includes %s", kustomization)
		}
		if !strings.Contains(string(data), "- "+f+"\n") {
			t.Errorf("%s does not list %s", kustomization, f)
		}
	}
	if _, err := Objects(); err != nil {
		t.Error(err)
	}
}
