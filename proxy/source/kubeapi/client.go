package kubeapi

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
)

// Client is what a Source asks of the API server: to list and watch Services and
// EndpointSlices in every namespace, and Nodes. NewClient makes one.
type Client interface {
	Services() ListWatcher
	EndpointSlices() ListWatcher
	Nodes() ListWatcher
}

// ListWatcher lists and watches one resource.
type ListWatcher interface {
	List(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

// NewClient returns a Client for cfg: a REST client for core/v1 and one for
// discovery.k8s.io/v1, sharing one HTTP client (and so its connections), with a scheme that
// knows only the types the source reads. It asks what client-go's typed clients ask, but
// without their clientset, whose scheme links every API group of Kubernetes into the binary:
// about 10 MB more code, most of it paged in at start on every node.
func NewClient(cfg *rest.Config) (Client, error) {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{v1.AddToScheme, discovery.AddToScheme} {
		if err := add(scheme); err != nil {
			return nil, fmt.Errorf("API client scheme: %w", err)
		}
	}
	codecs := serializer.NewCodecFactory(scheme)
	params := runtime.NewParameterCodec(scheme)
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("API client for %s: %w", cfg.Host, err)
	}
	restFor := func(gv schema.GroupVersion, apiPath string) (*rest.RESTClient, error) {
		c := rest.CopyConfig(cfg)
		c.GroupVersion = &gv
		c.APIPath = apiPath
		c.NegotiatedSerializer = codecs.WithoutConversion()
		if c.UserAgent == "" {
			c.UserAgent = rest.DefaultKubernetesUserAgent()
		}
		rc, err := rest.RESTClientForConfigAndClient(c, hc)
		if err != nil {
			return nil, fmt.Errorf("API client for %s %s: %w", cfg.Host, gv, err)
		}
		return rc, nil
	}
	core, err := restFor(v1.SchemeGroupVersion, "/api")
	if err != nil {
		return nil, err
	}
	disc, err := restFor(discovery.SchemeGroupVersion, "/apis")
	if err != nil {
		return nil, err
	}
	return &restClient{
		services:       resource{c: core, name: "services", params: params},
		endpointSlices: resource{c: disc, name: "endpointslices", params: params},
		nodes:          resource{c: core, name: "nodes", params: params},
	}, nil
}

type restClient struct {
	services, endpointSlices, nodes resource
}

func (c *restClient) Services() ListWatcher       { return c.services }
func (c *restClient) EndpointSlices() ListWatcher { return c.endpointSlices }
func (c *restClient) Nodes() ListWatcher          { return c.nodes }

// resource lists and watches one resource in every namespace, the way client-go's generated
// clients do.
type resource struct {
	c      *rest.RESTClient
	name   string
	params runtime.ParameterCodec
}

func (r resource) List(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
	return r.c.Get().Resource(r.name).VersionedParams(&opts, r.params).
		Timeout(timeoutOf(opts)).Do(ctx).Get()
}

func (r resource) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	opts.Watch = true
	return r.c.Get().Resource(r.name).VersionedParams(&opts, r.params).
		Timeout(timeoutOf(opts)).Watch(ctx)
}

// timeoutOf is the request timeout opts ask for (0: none).
func timeoutOf(opts metav1.ListOptions) time.Duration {
	if opts.TimeoutSeconds == nil {
		return 0
	}
	return time.Duration(*opts.TimeoutSeconds) * time.Second
}
