// Package deploy holds the Kubernetes manifests that run kube-userspace-proxy on every node
// (ServiceAccount, ClusterRole, ClusterRoleBinding, ConfigMap, DaemonSet) and decodes them, for
// the end-to-end test that applies them and for the demo.
//
// Apply them with kubectl apply -k (kustomization.yaml) or kubectl apply -f after setting the
// DaemonSet's image and the API server's address in the ConfigMap's kubeconfig.conf
// (docs/cluster.md).
package deploy

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"sort"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
)

//go:embed *.yaml
var manifests embed.FS

// kustomization is kustomize's file, not an object of the API.
const kustomization = "kustomization.yaml"

// Files returns the manifest files' names, sorted (not kustomization.yaml).
func Files() []string {
	all, _ := fs.Glob(manifests, "*.yaml") // the pattern is valid: no error
	names := all[:0]
	for _, n := range all {
		if n != kustomization {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	return names
}

// Objects decodes every object of the named manifest files (all of them when none is named), in
// file order.
func Objects(names ...string) ([]*unstructured.Unstructured, error) {
	if len(names) == 0 {
		names = Files()
	}
	var out []*unstructured.Unstructured
	for _, name := range names {
		data, err := manifests.ReadFile(name)
		if err != nil {
			return nil, fmt.Errorf("read manifest %s: %w", name, err)
		}
		objs, err := Decode(data)
		if err != nil {
			return nil, fmt.Errorf("manifest %s: %w", name, err)
		}
		out = append(out, objs...)
	}
	return out, nil
}

// Decode splits a multi-document YAML (or JSON) stream into objects, skipping empty documents.
func Decode(data []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var out []*unstructured.Unstructured
	for i := 0; ; i++ {
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, fmt.Errorf("decode document %d: %w", i, err)
		}
		if len(m) == 0 {
			continue
		}
		u := &unstructured.Unstructured{Object: m}
		if u.GetKind() == "" || u.GetAPIVersion() == "" {
			return nil, fmt.Errorf("decode document %d: apiVersion and kind are required", i)
		}
		out = append(out, u)
	}
}

// Applier applies objects with server-side apply through a dynamic client, mapping kinds to
// resources with the API server's discovery.
type Applier struct {
	dyn    dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
	// FieldManager is the apply field manager; empty means "kube-userspace-proxy-deploy".
	FieldManager string
}

// NewApplier returns an Applier for the API server of cfg.
func NewApplier(cfg *rest.Config) (*Applier, error) {
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("discovery client for %s: %w", cfg.Host, err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("dynamic client for %s: %w", cfg.Host, err)
	}
	return &Applier{dyn: dyn, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))}, nil
}

// Apply server-side applies obj (forcing conflicts); with dryRun the server validates and
// admits it (DryRun: All) but stores nothing.
func (a *Applier) Apply(ctx context.Context, obj *unstructured.Unstructured, dryRun bool) error {
	gvk := obj.GroupVersionKind()
	m, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return fmt.Errorf("apply %s %s: map kind to resource: %w", gvk.Kind, obj.GetName(), err)
	}
	manager := a.FieldManager
	if manager == "" {
		manager = "kube-userspace-proxy-deploy"
	}
	opts := metav1.ApplyOptions{FieldManager: manager, Force: true}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	var ri dynamic.ResourceInterface = a.dyn.Resource(m.Resource)
	if ns := obj.GetNamespace(); ns != "" {
		ri = a.dyn.Resource(m.Resource).Namespace(ns)
	}
	if _, err := ri.Apply(ctx, obj.GetName(), obj, opts); err != nil {
		return fmt.Errorf("apply %s %s/%s (dry run %v): %w", gvk.Kind, obj.GetNamespace(), obj.GetName(), dryRun, err)
	}
	return nil
}
