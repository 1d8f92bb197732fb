package deploy

import (
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/app"
)

// TestManifests checks what the API server's dry run cannot: the ConfigMap's configuration is
// one the proxy accepts, and the DaemonSet keeps the properties the README promises.
// kubeletCriticalOOMScoreAdj is the OOM score the kubelet gives the containers of a
// system-node-critical pod.
const kubeletCriticalOOMScoreAdj = -997

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
	// The OOM score the configuration asks for is one the container can set: without
	// CAP_SYS_RESOURCE, not below the kubelet's score for a system-node-critical pod.
	if spec("priorityClassName") != "system-node-critical" {
		t.Errorf("DaemonSet priorityClassName %v, want system-node-critical", spec("priorityClassName"))
	}
	if o.OOMScoreAdj < kubeletCriticalOOMScoreAdj {
		t.Errorf("ConfigMap oomScoreAdj %d: below the kubelet's %d for a system-node-critical pod, which needs CAP_SYS_RESOURCE (capabilities %v)", o.OOMScoreAdj, kubeletCriticalOOMScoreAdj, caps)
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

	// Ready only when the container's own proxy serves the node: an httpGet probe of the
	// node's port is answered by the old proxy during a rolling update. The exec probe reads
	// the ready file the proxy's command names, with the proxy's configuration.
	args, _, _ := unstructured.NestedStringSlice(c, "command")
	flag := func(cmd []string, name string) string {
		for _, a := range cmd {
			if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
				return v
			}
		}
		return ""
	}
	probe, _, _ := unstructured.NestedStringSlice(c, "readinessProbe", "exec", "command")
	switch {
	case len(probe) == 0 || probe[0] != args[0] || !slices.Contains(probe, "--probe-ready"):
		t.Errorf("DaemonSet readinessProbe: exec %v, want %s --probe-ready", probe, args[0])
	case flag(args, "ready-file") == "" || flag(probe, "ready-file") != flag(args, "ready-file"):
		t.Errorf("DaemonSet: --ready-file %q in the readiness probe, %q in the proxy's command: want one path", flag(probe, "ready-file"), flag(args, "ready-file"))
	case !strings.HasPrefix(flag(args, "ready-file"), "/tmp/"):
		t.Errorf("DaemonSet: --ready-file %q: want a path of the container's own (/tmp), not one the old pod shares", flag(args, "ready-file"))
	case flag(probe, "config") != flag(args, "config"):
		t.Errorf("DaemonSet readinessProbe: --config %q, the proxy's %q (the probe finds /healthz there)", flag(probe, "config"), flag(args, "config"))
	}
	// The holder: a sidecar (started before the proxy, stopped after it) running `hold` on the
	// socket the proxy's --holder-socket names, in a directory of the pod's own (an emptyDir
	// both mount), with no capability.
	var holder map[string]any
	inits, _ := spec("initContainers").([]any)
	for _, ic := range inits {
		if m := ic.(map[string]any); m["name"] == "holder" {
			holder = m
		}
	}
	if holder == nil {
		t.Fatal("DaemonSet: no holder init container")
	}
	// The conntrack sysctls: set by a privileged init container that runs --conntrack-only with
	// the proxy's configuration and exits (not a sidecar), before the proxy starts.
	var ct map[string]any
	for _, ic := range inits {
		if m := ic.(map[string]any); m["name"] == "conntrack" {
			ct = m
		}
	}
	if ct == nil {
		t.Fatal("DaemonSet: no conntrack init container")
	}
	ctcmd, _, _ := unstructured.NestedStringSlice(ct, "command")
	ctpriv, _, _ := unstructured.NestedBool(ct, "securityContext", "privileged")
	switch {
	case len(ctcmd) == 0 || ctcmd[0] != args[0] || !slices.Contains(ctcmd, "--conntrack-only"):
		t.Errorf("DaemonSet conntrack: command %v, want %s --conntrack-only", ctcmd, args[0])
	case flag(ctcmd, "config") == "" || flag(ctcmd, "config") != flag(args, "config"):
		t.Errorf("DaemonSet conntrack: --config %q, the proxy's %q: want one configuration", flag(ctcmd, "config"), flag(args, "config"))
	case !ctpriv:
		t.Error("DaemonSet conntrack: not privileged (/proc/sys is read-only otherwise)")
	case ct["restartPolicy"] != nil:
		t.Errorf("DaemonSet conntrack: restartPolicy %v: it runs once, before the proxy", ct["restartPolicy"])
	}
	if o.ConntrackTCPCloseWaitTimeout != time.Hour || o.ConntrackTCPEstablishedTimeout != 24*time.Hour {
		t.Errorf("ConfigMap conntrack: close-wait %v, established %v: want kube-proxy's 1h and 24h", o.ConntrackTCPCloseWaitTimeout, o.ConntrackTCPEstablishedTimeout)
	}
	hcmd, _, _ := unstructured.NestedStringSlice(holder, "command")
	mountOf := func(c map[string]any, path string) string {
		for _, m := range c["volumeMounts"].([]any) {
			mm := m.(map[string]any)
			if dir := mm["mountPath"].(string); strings.HasPrefix(path, dir+"/") {
				return mm["name"].(string)
			}
		}
		return ""
	}
	sock := flag(args, "holder-socket")
	switch {
	case holder["restartPolicy"] != "Always":
		t.Errorf("DaemonSet holder: restartPolicy %v, want Always (a sidecar)", holder["restartPolicy"])
	case len(hcmd) < 2 || hcmd[0] != args[0] || hcmd[1] != "hold":
		t.Errorf("DaemonSet holder: command %v, want %s hold", hcmd, args[0])
	case sock == "" || flag(hcmd, "socket") != sock:
		t.Errorf("DaemonSet holder: --socket %q, the proxy's --holder-socket %q: want one path", flag(hcmd, "socket"), sock)
	case mountOf(holder, sock) == "" || mountOf(holder, sock) != mountOf(c, sock):
		t.Errorf("DaemonSet: the holder's socket %s is in volume %q for the holder, %q for the proxy", sock, mountOf(holder, sock), mountOf(c, sock))
	}
	for _, v := range spec("volumes").([]any) {
		if vm := v.(map[string]any); vm["name"] == mountOf(c, sock) {
			if _, ok := vm["emptyDir"]; !ok {
				t.Errorf("DaemonSet: the holder's volume %v is not an emptyDir: its socket must be the pod's own", vm)
			}
		}
	}
	if hc, _, _ := unstructured.NestedStringSlice(holder, "securityContext", "capabilities", "add"); len(hc) > 0 {
		t.Errorf("DaemonSet holder: capabilities %v, want none", hc)
	}

	if pre, ok, _ := unstructured.NestedFieldNoCopy(c, "lifecycle", "preStop"); ok {
		t.Errorf("DaemonSet: preStop %v: the readiness probe makes a rolling update wait for the hand-over; a sleep would only delay the old pod's deletion", pre)
	}
	grace, _ := spec("terminationGracePeriodSeconds").(float64)
	if sgp, err := time.ParseDuration(flag(args, "shutdown-grace-period")); err != nil || time.Duration(grace)*time.Second <= sgp {
		t.Errorf("DaemonSet: terminationGracePeriodSeconds %v, --shutdown-grace-period %q: want the pod's longer", grace, flag(args, "shutdown-grace-period"))
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
