package proxy

import (
	"errors"

	"k8s.io/apimachinery/pkg/types"
)

// Problem is something that keeps the proxy from serving a Service as the Service asks: an
// invalid field it ignores, a service port without a listener, endpoints it refuses. The
// Tracker and the proxier report each one when it begins (not at every sync while it lasts);
// the proxy turns them into Warning Events on the Service, so that `kubectl describe service`
// says what the node's log says.
type Problem struct {
	Service types.NamespacedName
	// UID is the Service's UID when the reporter knows it; "" leaves finding it to the receiver.
	UID types.UID
	// Reason is one of the Reason constants: CamelCase, as Kubernetes Event reasons are.
	Reason string
	// Message names the field or the service port, and says what the proxy does instead.
	Message string
}

// Problem reasons.
const (
	// ReasonInvalidField: a field of the Service (an annotation of the proxy's included) has a
	// value the proxy cannot use; it ignores the field and serves the rest.
	ReasonInvalidField = "InvalidField"
	// ReasonProxyPortExhausted: no port of --proxy-port-range is free for a service port's
	// listener; its portals reject until one frees up.
	ReasonProxyPortExhausted = "ProxyPortExhausted"
	// ReasonListenFailed: a service port's listener could not be opened for another reason.
	ReasonListenFailed = "ListenFailed"
	// ReasonDescriptorLimit: the open-files limit leaves no descriptor for a service port's
	// listener; its portals reject until descriptors free up.
	ReasonDescriptorLimit = "DescriptorLimit"
	// ReasonEndpointRefused: endpoints of a service port are the proxy itself (they would loop
	// back into it); they are left out and the port's other endpoints are used.
	ReasonEndpointRefused = "EndpointRefused"
)

// FieldProblems returns the Problems of err, as FromService returns it for the Service svc
// (uid): one ReasonInvalidField Problem per FieldError, its message the field and the detail.
func FieldProblems(svc types.NamespacedName, uid types.UID, err error) []Problem {
	var out []Problem
	var walk func(error)
	walk = func(err error) {
		if err == nil {
			return
		}
		if fe, ok := err.(*FieldError); ok {
			out = append(out, Problem{Service: svc, UID: uid, Reason: ReasonInvalidField,
				Message: fe.Field + ": " + fe.Detail + "; the field is ignored, the rest of the Service is served"})
			return
		}
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				walk(e)
			}
			return
		}
		walk(errors.Unwrap(err))
	}
	walk(err)
	return out
}
