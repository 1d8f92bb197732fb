package healthcheck

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/rs/zerolog"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

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
}

// Services runs the healthCheckNodePort servers. Feed it with Sync or PortsSynced; Close stops
// every server. Its methods are safe for concurrent use.
type Services struct {
	opts ServicesOptions
	log  zerolog.Logger

	mu       sync.Mutex // guards the following fields
	services map[types.NamespacedName]*instance
	closed   bool
}

var _ proxy.SyncObserver = (*Services)(nil)

// instance is the server of one service: one http.Server per listen address.
type instance struct {
	name    types.NamespacedName
	port    int
	servers []*http.Server
	served  sync.WaitGroup // the Serve goroutines

	mu        sync.Mutex // guards endpoints
	endpoints int
}

// NewServices returns Services with no server running.
func NewServices(opts ServicesOptions) *Services {
	if opts.Listen == nil {
		opts.Listen = net.Listen
	}
	return &Services{opts: opts, log: opts.Log, services: map[types.NamespacedName]*instance{}}
}

// SyncDone does nothing (proxy.SyncObserver).
func (s *Services) SyncDone(time.Time, time.Duration, time.Time, error) {}

// ChangeQueued does nothing (proxy.SyncObserver).
func (s *Services) ChangeQueued(time.Time) {}

// PortsSynced derives the wanted servers from the proxier's port states and applies them
// (proxy.SyncObserver): every service with externalTrafficPolicy: Local and a
// healthCheckNodePort gets a server, reporting the distinct IPs of the service's ready local
// endpoints over all its ports (kube-proxy's count).
func (s *Services) PortsSynced(ports []proxy.PortState) {
	s.Sync(Wanted(ports))
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
			inst.close()
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
	inst := &instance{name: name, port: port}
	addrs := s.opts.Addrs
	if addrs == nil {
		addrs = []netip.Addr{{}}
	}
	for _, a := range addrs {
		network, address := listenAddress(a, port)
		ln, err := s.opts.Listen(network, address)
		if err != nil {
			inst.close()
			return nil, fmt.Errorf("listen for the health check of service %s on %s: %w", name, address, err)
		}
		srv := &http.Server{Handler: s.handler(inst), ReadHeaderTimeout: 10 * time.Second}
		inst.servers = append(inst.servers, srv)
		inst.served.Add(1)
		go func() {
			defer inst.served.Done()
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				s.log.Error().Err(err).Str("service", name.String()).Msg("health check server stopped")
			}
		}()
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
func (inst *instance) close() {
	for _, srv := range inst.servers {
		_ = srv.Close()
	}
	inst.served.Wait()
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

// Close stops every server and waits for them; later Syncs do nothing.
func (s *Services) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	for name, inst := range s.services {
		inst.close()
		delete(s.services, name)
	}
}
