// Package healthcheck serves the proxy's HTTP health endpoints, with kube-proxy's semantics and
// bodies:
//
//   - ProxyHealth: /healthz and /livez on --healthz-bind-address. Healthy while every queued
//     change is applied, or the oldest unapplied one is younger than the timeout (kube-proxy uses
//     2 × --iptables-sync-period).
//   - Services: one HTTP server per healthCheckNodePort of the externalTrafficPolicy: Local
//     load-balancer services, answering 200 when this node has at least one ready endpoint of
//     the service and 503 otherwise, so that load balancers send traffic only to nodes that
//     serve it. They run on package httpserve: timeouts on every phase of a connection, and one
//     cap on the open connections of all of them together (DefaultServicesMaxConns).
//
// Both are fed each sync's proxy.SyncResult (Synced); ProxyHealth is also told when a change
// starts waiting (Queued). The package knows nothing of the proxier, sockets of the data path or
// iptables: it reads only the model (package proxy).
package healthcheck

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// ProxyHealthOptions configures a ProxyHealth.
type ProxyHealthOptions struct {
	// Timeout is how long a queued change may wait for a sync before the proxy is unhealthy;
	// kube-proxy uses 2 × --iptables-sync-period. Zero means one minute.
	Timeout time.Duration
	// Now returns the current time; nil means time.Now.
	Now func() time.Time
	// Source, if set, reports on the source's connection to the API server (package
	// proxy/source/kubeapi). Nil (a manifests directory) means always connected and eligible.
	Source SourceStatus
}

// SourceStatus is what ProxyHealth reports of a source that watches an API server.
type SourceStatus interface {
	// Err returns the API server failure the source is retrying after (nil when connected). It
	// is reported in the body as "sourceError" and does not change the status: the proxy keeps
	// serving its last state, and probes must not restart it for an outage of the API server.
	Err() error
	// NodeEligible reports whether this node should get load-balancer traffic (false while its
	// Node is being deleted or is tainted ToBeDeletedByClusterAutoscaler). /healthz then
	// answers 503 with "nodeEligible": false, as kube-proxy's does, so that load balancers drain
	// the node; /livez is not affected.
	NodeEligible() bool
}

// ProxyHealth tracks whether the proxy keeps its rules up to date and serves /healthz and /livez.
// Its methods are safe for concurrent use.
type ProxyHealth struct {
	timeout time.Duration
	now     func() time.Time
	source  SourceStatus

	mu sync.Mutex // guards the following fields
	// lastUpdated is when the last successful sync ended (zero before the first).
	lastUpdated time.Time
	// oldestQueued is when the oldest change not yet applied by a successful sync was queued
	// (zero when none is pending).
	oldestQueued time.Time
}

// NewProxyHealth returns a ProxyHealth; the proxy counts as healthy until a change waits longer
// than the timeout (a proxy that is starting is healthy, as in kube-proxy).
func NewProxyHealth(opts ProxyHealthOptions) *ProxyHealth {
	if opts.Timeout <= 0 {
		opts.Timeout = time.Minute
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &ProxyHealth{timeout: opts.Timeout, now: opts.Now, source: opts.Source}
}

// Synced marks the rules up to date when the sync succeeded. A failed sync leaves pending
// changes pending, so a proxy that keeps failing turns unhealthy.
func (h *ProxyHealth) Synced(r proxy.SyncResult) {
	if r.Err != nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.oldestQueued = time.Time{}
	h.lastUpdated = h.now()
}

// Queued records a change waiting for a sync. Only the oldest pending change counts.
func (h *ProxyHealth) Queued(time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.oldestQueued.IsZero() {
		h.oldestQueued = h.now()
	}
}

// IsHealthy reports whether no change has waited longer than the timeout.
func (h *ProxyHealth) IsHealthy() bool {
	ok, _, _ := h.state()
	return ok
}

func (h *ProxyHealth) state() (healthy bool, lastUpdated, now time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	now = h.now()
	healthy = h.oldestQueued.IsZero() || now.Sub(h.oldestQueued) < h.timeout
	return healthy, h.lastUpdated, now
}

// Handler serves /healthz and /livez. Both answer 200 when healthy and 503 otherwise, with
// kube-proxy's headers and body: {"lastUpdated": "...","currentTime": "..."} (Go's time.Time
// String form, quoted), plus "nodeEligible" on /healthz. As in kube-proxy, a healthy answer
// reports lastUpdated as the current time. /healthz is also 503 while the node is not eligible
// (ProxyHealthOptions.NodeEligible).
func (h *ProxyHealth) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { h.serve(w, true) })
	mux.HandleFunc("/livez", func(w http.ResponseWriter, _ *http.Request) { h.serve(w, false) })
	return mux
}

func (h *ProxyHealth) serve(w http.ResponseWriter, withNode bool) {
	healthy, lastUpdated, now := h.state()
	nodeEligible := h.source == nil || h.source.NodeEligible()
	if withNode {
		healthy = healthy && nodeEligible
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if healthy {
		lastUpdated = now
		w.WriteHeader(http.StatusOK)
	} else {
		w.WriteHeader(http.StatusServiceUnavailable)
	}
	extra := ""
	if h.source != nil {
		if err := h.source.Err(); err != nil {
			msg, _ := json.Marshal(err.Error())
			extra = `, "sourceError": ` + string(msg)
		}
	}
	if withNode {
		fmt.Fprintf(w, `{"lastUpdated": %q,"currentTime": %q, "nodeEligible": %v%s}`, lastUpdated, now, nodeEligible, extra)
		return
	}
	fmt.Fprintf(w, `{"lastUpdated": %q,"currentTime": %q%s}`, lastUpdated, now, extra)
}
