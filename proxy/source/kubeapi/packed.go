package kubeapi

import (
	"fmt"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// packed is a Service or an EndpointSlice as the informers cache it: its identity (what the
// informer's keys and the reflector read: name, namespace, uid, resourceVersion) and the
// protobuf encoding of the trimmed object, unmarshalled again only to be handed to the Handler,
// which keeps what it derives, not the object. A decoded Service or EndpointSlice of one port
// and one endpoint is ~1 KB (a slice's labels map alone ~450 B); packed, ~0.5 KB. The informers
// cache every object of the cluster for the life of the process: at 10,000 services this is
// ~10 MB.
type packed struct {
	metav1.TypeMeta
	metav1.ObjectMeta        // Name, Namespace, UID and ResourceVersion only
	pb                []byte // the trimmed object, protobuf-encoded; never changed
}

var _ runtime.Object = (*packed)(nil)

// DeepCopyObject implements runtime.Object. The encoding is shared: it is never changed.
func (p *packed) DeepCopyObject() runtime.Object {
	c := &packed{TypeMeta: p.TypeMeta, pb: p.pb}
	p.ObjectMeta.DeepCopyInto(&c.ObjectMeta)
	return c
}

// protoObject is what pack encodes: the k8s.io/api types' generated protobuf marshalling.
type protoObject interface {
	metav1.Object
	Marshal() ([]byte, error)
}

// pack returns the packed form of a Service or an EndpointSlice, and other objects (a Node) as
// they are. An object that does not encode (it cannot happen: the API server sent it) is kept
// as it is too: the handlers take both forms.
func pack(obj any) any {
	var o protoObject
	switch x := obj.(type) {
	case *v1.Service:
		o = x
	case *discovery.EndpointSlice:
		o = x
	default:
		return obj
	}
	pb, err := o.Marshal()
	if err != nil {
		return obj
	}
	p := &packed{pb: pb}
	p.Name, p.Namespace, p.UID, p.ResourceVersion = o.GetName(), o.GetNamespace(), o.GetUID(), o.GetResourceVersion()
	return p
}

// unpacker is the generated protobuf unmarshalling of a k8s.io/api type T.
type unpacker[T any] interface {
	*T
	Unmarshal([]byte) error
}

// unpack decodes a packed object into a new T.
func unpack[T any, PT unpacker[T]](p *packed) (*T, error) {
	t := new(T)
	if err := PT(t).Unmarshal(p.pb); err != nil {
		return nil, fmt.Errorf("unmarshal the cached %s/%s again: %w", p.Namespace, p.Name, err)
	}
	return t, nil
}

// trimAndPack is every informer's transform: trimObject, then pack.
func trimAndPack(obj any) (any, error) {
	o, err := trimObject(obj)
	if err != nil {
		return o, err
	}
	return pack(o), nil
}
