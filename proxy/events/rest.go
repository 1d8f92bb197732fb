package events

import (
	"context"
	"errors"
	"fmt"

	v1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
)

// restSink is a Sink on the API server: events.k8s.io/v1 Events, and core/v1 Services to find a
// Service's UID (with list, which the proxy may do, rather than get).
type restSink struct {
	events, core *rest.RESTClient
	params       runtime.ParameterCodec
}

// NewRESTSink returns a Sink writing to the API server of cfg. Events are sent as JSON: the
// API server takes them in either encoding, and a few a minute cost nothing to encode.
func NewRESTSink(cfg *rest.Config) (Sink, error) {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{v1.AddToScheme, eventsv1.AddToScheme} {
		if err := add(scheme); err != nil {
			return nil, fmt.Errorf("events API client scheme: %w", err)
		}
	}
	codecs := serializer.NewCodecFactory(scheme)
	client := func(gv schema.GroupVersion, apiPath string) (*rest.RESTClient, error) {
		c := rest.CopyConfig(cfg)
		c.GroupVersion = &gv
		c.APIPath = apiPath
		c.ContentType = runtime.ContentTypeJSON
		c.AcceptContentTypes = runtime.ContentTypeJSON
		c.NegotiatedSerializer = codecs.WithoutConversion()
		if c.UserAgent == "" {
			c.UserAgent = rest.DefaultKubernetesUserAgent()
		}
		rc, err := rest.RESTClientFor(c)
		if err != nil {
			return nil, fmt.Errorf("events API client for %s %s: %w", cfg.Host, gv, err)
		}
		return rc, nil
	}
	ev, err := client(eventsv1.SchemeGroupVersion, "/apis")
	if err != nil {
		return nil, err
	}
	core, err := client(v1.SchemeGroupVersion, "/api")
	if err != nil {
		return nil, err
	}
	return &restSink{events: ev, core: core, params: runtime.NewParameterCodec(scheme)}, nil
}

func (s *restSink) Create(ctx context.Context, ev *eventsv1.Event) (string, error) {
	out := &eventsv1.Event{}
	err := s.events.Post().Namespace(ev.Namespace).Resource("events").Body(ev).Do(ctx).Into(out)
	if err != nil {
		return "", fmt.Errorf("create event %s/%s: %w", ev.Namespace, ev.Name, err)
	}
	return out.Name, nil
}

func (s *restSink) PatchSeries(ctx context.Context, namespace, name string, series eventsv1.EventSeries) error {
	patch, err := seriesPatch(series)
	if err != nil {
		return err
	}
	err = s.events.Patch(types.MergePatchType).Namespace(namespace).Resource("events").Name(name).Body(patch).Do(ctx).Error()
	if err != nil {
		return fmt.Errorf("patch series of event %s/%s: %w", namespace, name, err)
	}
	return nil
}

func (s *restSink) ServiceUID(ctx context.Context, namespace, name string) (types.UID, bool, error) {
	opts := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()}
	list := &v1.ServiceList{}
	err := s.core.Get().Namespace(namespace).Resource("services").VersionedParams(&opts, s.params).Do(ctx).Into(list)
	if err != nil {
		return "", false, fmt.Errorf("find service %s/%s: %w", namespace, name, err)
	}
	for _, svc := range list.Items {
		if svc.Name == name {
			return svc.UID, true, nil
		}
	}
	return "", false, nil
}

// retriable reports whether a create that failed with err may succeed when tried again: it did
// not reach the API server, or the server was overloaded or failing (429, 5xx). Other answers
// (invalid, forbidden, exists) are final.
func retriable(err error) bool {
	var st apierrors.APIStatus
	if !errors.As(err, &st) {
		return !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
	}
	code := st.Status().Code
	return code == 429 || code >= 500
}
