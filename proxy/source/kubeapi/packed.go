package kubeapi

import (
	"fmt"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
)

// packed is a Service or an EndpointSlice as the informers cache it: its identity (what the
// informer's keys and the reflector read: name, namespace, uid, resourceVersion) and the
// protobuf encoding of the trimmed object, unmarshalled again only to be handed to the Handler,
// which keeps what it derives, not the object. A decoded Service or EndpointSlice of one port
// and one endpoint is ~1 KB (a slice's labels map alone ~450 B); packed, ~0.3 KB. The informers
// cache every object of the cluster for the life of the process: at 10,000 services this is
// ~10 MB.
type packed struct {
	name, namespace, resourceVersion string
	uid                              types.UID
	pb                               []byte // the trimmed object, protobuf-encoded; never changed
}

var (
	_ runtime.Object = (*packed)(nil)
	_ metav1.Object  = (*packed)(nil)
)

// GetObjectKind implements runtime.Object: a packed object carries no type information.
func (p *packed) GetObjectKind() schema.ObjectKind { return schema.EmptyObjectKind }

// DeepCopyObject implements runtime.Object. The encoding is shared: it is never changed.
func (p *packed) DeepCopyObject() runtime.Object {
	c := *p
	return &c
}

// The metav1.Object methods: what the informer's keys and the reflector read. A packed object
// has no other metadata of its own (its encoding has all of it): the other getters return
// nothing and the other setters do nothing. (ObjectMeta embedded would cost ~240 bytes per
// cached object.)

func (p *packed) GetNamespace() string                          { return p.namespace }
func (p *packed) SetNamespace(v string)                         { p.namespace = v }
func (p *packed) GetName() string                               { return p.name }
func (p *packed) SetName(v string)                              { p.name = v }
func (p *packed) GetGenerateName() string                       { return "" }
func (p *packed) SetGenerateName(string)                        {}
func (p *packed) GetUID() types.UID                             { return p.uid }
func (p *packed) SetUID(v types.UID)                            { p.uid = v }
func (p *packed) GetResourceVersion() string                    { return p.resourceVersion }
func (p *packed) SetResourceVersion(v string)                   { p.resourceVersion = v }
func (p *packed) GetGeneration() int64                          { return 0 }
func (p *packed) SetGeneration(int64)                           {}
func (p *packed) GetSelfLink() string                           { return "" }
func (p *packed) SetSelfLink(string)                            {}
func (p *packed) GetCreationTimestamp() metav1.Time             { return metav1.Time{} }
func (p *packed) SetCreationTimestamp(metav1.Time)              {}
func (p *packed) GetDeletionTimestamp() *metav1.Time            { return nil }
func (p *packed) SetDeletionTimestamp(*metav1.Time)             {}
func (p *packed) GetDeletionGracePeriodSeconds() *int64         { return nil }
func (p *packed) SetDeletionGracePeriodSeconds(*int64)          {}
func (p *packed) GetLabels() map[string]string                  { return nil }
func (p *packed) SetLabels(map[string]string)                   {}
func (p *packed) GetAnnotations() map[string]string             { return nil }
func (p *packed) SetAnnotations(map[string]string)              {}
func (p *packed) GetFinalizers() []string                       { return nil }
func (p *packed) SetFinalizers([]string)                        {}
func (p *packed) GetOwnerReferences() []metav1.OwnerReference   { return nil }
func (p *packed) SetOwnerReferences([]metav1.OwnerReference)    {}
func (p *packed) GetManagedFields() []metav1.ManagedFieldsEntry { return nil }
func (p *packed) SetManagedFields([]metav1.ManagedFieldsEntry)  {}

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
	return &packed{name: o.GetName(), namespace: o.GetNamespace(), uid: o.GetUID(), resourceVersion: o.GetResourceVersion(), pb: pb}
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
		return nil, fmt.Errorf("unmarshal the cached %s/%s again: %w", p.namespace, p.name, err)
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
