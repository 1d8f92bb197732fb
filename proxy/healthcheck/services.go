package healthcheck

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"sync"

	"github.com/rs/zerolog"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/httpserve"
)

// DefaultServicesMaxConns caps the open connections of all the healthCheckNodePort servers
// together: one cap for all, so that what a flood of them costs (file descriptors above all)
// does not grow with the number of services.
const DefaultServicesMaxConns = 4 * httpserve.DefaultMaxConns

// Service is what the health check server of one service needs.
type Service struct {
	// Port is the service's healthCheckNodePort.
	Port int
	// LocalEndpoints is the number of this node's ready endpoints of the service (distinct IPs).
	LocalEndpoints int
}

// Checker reports the proxy's own health; ProxyHealth implements it.
type Checker interface {
	IsHealthy() bool
}

// ServicesOptions configures Services.
type ServicesOptions struct {
	// Log is the component's logger; the zero value logs nothing.
	Log zerolog.Logger
	// Addrs are the addresses the servers listen on (--nodeport-addresses); nil means every
	// address of both families. An unspecified address (0.0.0.0, ::) means every address of its
	// family.
	Addrs []netip.Addr
	// Health, if set, makes every service answer 503 while the proxy is unhealthy (its rules may
	// be stale), as kube-proxy does. Nil means the proxy counts as healthy.
	Health Checker
	// Listen opens a listener; nil means net.Listen. For tests.
	Listen func(network, address string) (net.Listener, error)
	// Limits bound the servers' connections (zero fields: httpserve's defaults), except that
	// MaxConns caps the connections of all the servers together (zero:
	// DefaultServicesMaxConns).
	Limits httpserve.Limits
}

// Services runs the healthCheckNodePort servers. Feed it with Sync or Synced; Close stops
// every server. Its methods are safe for concurrent use.
type Services struct {
	opts  ServicesOptions
	log   zerolog.Logger
	conns *httpserve.ConnLimit // shared by every server

	mu       sync.Mutex // guards the following fields
	services map[types.NamespacedName]*instance
	closed   bool
}

// instance is the server of one service: one httpserve.Server per listen address.
type instance struct {
	name    types.NamespacedName
	port    int
	servers []*httpserve.Server
	// listeners are the servers' sockets, by "network address" (as Listen was called).
	listeners map[string]net.Listener

	mu        sync.Mutex // guards endpoints
	endpoints int
}

// NewServices returns Services with no server running.
func NewServices(opts ServicesOptions) *Services {
	if opts.Listen == nil {
		opts.Listen = net.Listen
	}
	if opts.Limits.MaxConns <= 0 {
		opts.Limits.MaxConns = DefaultServicesMaxConns
	}
	return &Services{
		opts:     opts,
		log:      opts.Log,
		conns:    httpserve.NewConnLimit(opts.Limits.MaxConns, opts.Log.With().Str("servers", "healthCheckNodePort").Logger()),
		services: map[types.NamespacedName]*instance{},
	}
}

// Synced derives the wanted servers from a sync's port states and applies them: every service
// with externalTrafficPolicy: Local and a healthCheckNodePort gets a server, reporting the
// distinct IPs of the service's ready local endpoints over all its ports (kube-proxy's count).
func (s *Services) Synced(r proxy.SyncResult) {
	s.Sync(Wanted(r.Ports))
}

// Wanted returns the health check servers ports need, per service.
func Wanted(ports []proxy.PortState) map[types.NamespacedName]Service {
	out := map[types.NamespacedName]Service{}
	ips := map[types.NamespacedName][]netip.Addr{}
	for _, st := range ports {
		sp := st.ServicePort
		if sp == nil || !sp.ExternalPolicyLocal || sp.HealthCheckNodePort == 0 {
			continue
		}
		svc := sp.Name.Service()
		for _, ip := range st.LocalReady {
			if !slices.Contains(ips[svc], ip) {
				ips[svc] = append(ips[svc], ip)
			}
		}
		out[svc] = Service{Port: sp.HealthCheckNodePort, LocalEndpoints: len(ips[svc])}
	}
	return out
}

// Sync makes the running servers match want: servers of services no longer wanted (or whose
// port changed) are closed, new ones opened, and every server's endpoint count updated. A server
// that cannot listen is logged and retried at the next Sync.
func (s *Services) Sync(want map[types.NamespacedName]Service) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	for name, inst := range s.services {
		if w, ok := want[name]; !ok || w.Port != inst.port {
			s.log.Info().Str("service", name.String()).Int("port", inst.port).Msg("closing health check server")
			inst.close(s.log)
			delete(s.services, name)
		}
	}
	for name, w := range want {
		inst := s.services[name]
		if inst == nil {
			var err error
			if inst, err = s.open(name, w.Port); err != nil {
				s.log.Error().Err(err).Msg("cannot start health check server; retrying at the next sync")
				continue
			}
			s.services[name] = inst
			s.log.Info().Str("service", name.String()).Int("port", w.Port).Msg("opened health check server")
		}
		inst.mu.Lock()
		inst.endpoints = w.LocalEndpoints
		inst.mu.Unlock()
	}
}

// open listens on every address and serves the service's health check.
func (s *Services) open(name types.NamespacedName, port int) (*instance, error) {
	inst := &instance{name: name, port: port, listeners: map[string]net.Listener{}}
	addrs := s.opts.Addrs
	if addrs == nil {
		addrs = []netip.Addr{{}}
	}
	for _, a := range addrs {
		network, address := listenAddress(a, port)
		ln, err := s.opts.Listen(network, address)
		if err != nil {
			inst.close(s.log)
			return nil, fmt.Errorf("listen for the health check of service %s on %s: %w", name, address, err)
		}
		inst.listeners[ListenKey(network, address)] = ln
		inst.servers = append(inst.servers, httpserve.Serve(ln, httpserve.Options{
			Handler: s.handler(inst),
			Limits:  s.opts.Limits,
			Conns:   s.conns,
			Log:     s.log.With().Str("service", name.String()).Logger(),
		}))
	}
	return inst, nil
}

func listenAddress(a netip.Addr, port int) (network, address string) {
	p := strconv.Itoa(port)
	switch {
	case !a.IsValid():
		return "tcp", net.JoinHostPort("", p)
	case a.Is4():
		return "tcp4", net.JoinHostPort(a.String(), p)
	}
	return "tcp6", net.JoinHostPort(a.String(), p)
}

// handler answers every path with the service's state, in kube-proxy's format.
func (s *Services) handler(inst *instance) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		inst.mu.Lock()
		n := inst.endpoints
		inst.mu.Unlock()
		healthy := s.opts.Health == nil || s.opts.Health.IsHealthy()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		if n > 0 && healthy {
			w.WriteHeader(http.StatusOK)
		} else {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		fmt.Fprintf(w, `{"service":{"namespace":%q,"name":%q},"localEndpoints":%d}`, inst.name.Namespace, inst.name.Name, n)
	})
}

// close stops the instance's servers and waits for their goroutines.
func (inst *instance) close(log zerolog.Logger) {
	for _, srv := range inst.servers {
		if err := srv.Close(); err != nil {
			log.Warn().Err(err).Str("service", inst.name.String()).Msg("closing health check server")
		}
	}
}

// ListenKey names a listener as Services opened it, for ListenerFiles and the Listen option.
func ListenKey(network, address string) string { return network + " " + address }

// ListenerFiles returns duplicates of every server's listening socket, by ListenKey, for a
// successor to serve on (its Listen option then returns them instead of binding).
func (s *Services) ListenerFiles() (map[string]*os.File, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]*os.File{}
	for _, inst := range s.services {
		for k, ln := range inst.listeners {
			fl, ok := ln.(interface{ File() (*os.File, error) })
			if !ok {
				continue
			}
			f, err := fl.File()
			if err != nil {
				for _, f := range out {
					f.Close()
				}
				return nil, fmt.Errorf("health check server %s of %s: %w", k, inst.name, err)
			}
			out[k] = f
		}
	}
	return out, nil
}

// Ports returns the ports of the running servers, by service (for tests and logs).
func (s *Services) Ports() map[types.NamespacedName]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[types.NamespacedName]int, len(s.services))
	for name, inst := range s.services {
		out[name] = inst.port
	}
	return out
}

// Shutdown stops every server like Close, gracefully: all stop accepting at once, and the
// requests in progress finish (until ctx ends, when the rest are cut). For a hand-over: the
// successor serves on the same sockets.
func (s *Services) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.closed = true
	var srvs []*httpserve.Server
	for name, inst := range s.services {
		srvs = append(srvs, inst.servers...)
		delete(s.services, name)
	}
	s.mu.Unlock()
	return httpserve.ShutdownAll(ctx, srvs...)
}

// Close stops every server and waits for them; later Syncs do nothing.
func (s *Services) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	for name, inst := range s.services {
		inst.close(s.log)
		delete(s.services, name)
	}
}
