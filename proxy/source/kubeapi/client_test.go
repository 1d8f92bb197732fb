package kubeapi

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/protobuf"
	"k8s.io/apimachinery/pkg/watch"
)

// TestClientRequests checks what NewClient's client asks of an API server — paths, query
// parameters, protobuf first — and that it decodes protobuf lists and JSON watch streams into
// the source's types.
func TestClientRequests(t *testing.T) {
	scheme := runtime.NewScheme()
	if err := v1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	pb := protobuf.NewSerializer(scheme, scheme)

	type request struct{ path, query, accept string }
	var mu sync.Mutex
	var got []request
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, request{r.URL.Path, r.URL.RawQuery, r.Header.Get("Accept")})
		mu.Unlock()
		switch {
		case r.URL.Path == "/api/v1/services":
			list := &v1.ServiceList{
				TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "ServiceList"},
				ListMeta: metav1.ListMeta{ResourceVersion: "7"},
				Items:    []v1.Service{{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web"}, Spec: v1.ServiceSpec{ClusterIP: "10.0.0.10"}}},
			}
			var buf bytes.Buffer
			if err := pb.Encode(list, &buf); err != nil {
				t.Error(err)
			}
			w.Header().Set("Content-Type", "application/vnd.kubernetes.protobuf")
			w.Write(buf.Bytes())
		case r.URL.Path == "/apis/discovery.k8s.io/v1/endpointslices":
			slice := &discovery.EndpointSlice{
				TypeMeta:    metav1.TypeMeta{APIVersion: "discovery.k8s.io/v1", Kind: "EndpointSlice"},
				ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: "web-1"},
				AddressType: discovery.AddressTypeIPv4,
			}
			raw, err := json.Marshal(slice)
			if err != nil {
				t.Error(err)
			}
			w.Header().Set("Content-Type", "application/json")
			ev, _ := json.Marshal(map[string]any{"type": "ADDED", "object": json.RawMessage(raw)})
			w.Write(append(ev, '\n'))
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()

	cfg, err := BuildConfig("", srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	obj, err := c.Services().List(ctx, metav1.ListOptions{LabelSelector: "!service.kubernetes.io/service-proxy-name", FieldSelector: "spec.clusterIP!=None"})
	if err != nil {
		t.Fatalf("list services: %v", err)
	}
	list, ok := obj.(*v1.ServiceList)
	if !ok || len(list.Items) != 1 || list.Items[0].Name != "web" || list.Items[0].Spec.ClusterIP != "10.0.0.10" || list.ResourceVersion != "7" {
		t.Fatalf("list services = %#v", obj)
	}

	timeout := int64(300)
	wi, err := c.EndpointSlices().Watch(ctx, metav1.ListOptions{ResourceVersion: "7", TimeoutSeconds: &timeout, AllowWatchBookmarks: true})
	if err != nil {
		t.Fatalf("watch endpointslices: %v", err)
	}
	select {
	case ev := <-wi.ResultChan():
		s, ok := ev.Object.(*discovery.EndpointSlice)
		if ev.Type != watch.Added || !ok || s.Name != "web-1" {
			t.Fatalf("watch event = %v %#v", ev.Type, ev.Object)
		}
	case <-ctx.Done():
		t.Fatal("no watch event")
	}
	wi.Stop()

	if _, err := c.Nodes().List(ctx, metav1.ListOptions{FieldSelector: "metadata.name=node1"}); err == nil {
		t.Fatal("list nodes from a server that has none: no error")
	}

	mu.Lock()
	defer mu.Unlock()
	want := []request{
		{path: "/api/v1/services", query: "fieldSelector=spec.clusterIP%21%3DNone&labelSelector=%21service.kubernetes.io%2Fservice-proxy-name"},
		{path: "/apis/discovery.k8s.io/v1/endpointslices", query: "allowWatchBookmarks=true&resourceVersion=7&timeout=5m0s&timeoutSeconds=300&watch=true"},
		{path: "/api/v1/nodes", query: "fieldSelector=metadata.name%3Dnode1"},
	}
	if len(got) != len(want) {
		t.Fatalf("requests: %+v, want %d", got, len(want))
	}
	for i, w := range want {
		if got[i].path != w.path || got[i].query != w.query {
			t.Errorf("request %d: %s?%s, want %s?%s", i, got[i].path, got[i].query, w.path, w.query)
		}
		if !strings.HasPrefix(got[i].accept, "application/vnd.kubernetes.protobuf") {
			t.Errorf("request %d: Accept %q, want protobuf first", i, got[i].accept)
		}
	}
}
