package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/httpserve"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/metrics"
)

// ProxyMode is what /proxyMode on the metrics server answers (kube-proxy answers its mode there).
const ProxyMode = "userspace"

// serverLimits bound the connections of every HTTP server; zero fields take httpserve's
// defaults (and healthcheck.DefaultServicesMaxConns for the healthCheckNodePort servers
// together). Tests shorten them.
var serverLimits httpserve.Limits

// servers are the proxy's HTTP servers, fed with every sync's result: /healthz and
// /livez, /metrics and /proxyMode, and the healthCheckNodePort servers. Each runs on
// httpserve: /healthz and /metrics have a connection cap each (a flood of one does not close the
// other's connections), the healthCheckNodePort servers share one.
type servers struct {
	log      zerolog.Logger
	metrics  *metrics.Metrics
	health   *healthcheck.ProxyHealth
	services *healthcheck.Services

	healthzAddr, metricsAddr string
	// profiling serves net/http/pprof under /debug/pprof/ on the metrics server.
	profiling bool
	// Listeners opened by listen, so bind errors are reported at startup; nil when disabled.
	healthzLn, metricsLn net.Listener

	// handedOver makes run finish gracefully: set when the successor took the sockets.
	handedOver atomic.Bool

	dropInherited sync.Once
	mu            sync.Mutex // guards inherited
	// inherited are the server sockets a predecessor handed over, until a server takes its own.
	inherited map[string]*os.File
}

// newServers builds the servers; listen opens their listeners.
func newServers(opts *Options, v *Validated, health healthcheck.ProxyHealthOptions, log zerolog.Logger) (*servers, error) {
	s := &servers{
		log:         log,
		metrics:     metrics.New(metrics.Options{}),
		health:      healthcheck.NewProxyHealth(health),
		healthzAddr: opts.HealthzBindAddress,
		metricsAddr: opts.MetricsBindAddress,
		profiling:   opts.Profiling,
		inherited:   map[string]*os.File{},
	}
	addrs, err := healthCheckAddrs(v.NodePortAddresses)
	if err != nil {
		return nil, err
	}
	s.services = healthcheck.NewServices(healthcheck.ServicesOptions{
		Log:    log.With().Str("component", "healthcheck").Logger(),
		Addrs:  addrs,
		Health: s.health,
		Limits: serverLimits,
		Listen: s.listenHealthCheck,
	})
	return s, nil
}

// listen opens the /healthz and /metrics listeners (empty addresses disable them), on the
// sockets a predecessor handed over where it did (inherited, by name ("healthz", "metrics", "healthcheck <network> <address>"); listen owns them),
// so bind errors are reported at startup.
func (s *servers) listen(inherited map[string]*os.File) error {
	s.mu.Lock()
	s.inherited = inherited
	s.mu.Unlock()
	for _, l := range []struct {
		addr string
		ln   *net.Listener
		what string
	}{{s.healthzAddr, &s.healthzLn, "healthz"}, {s.metricsAddr, &s.metricsLn, "metrics"}} {
		if l.addr == "" {
			continue
		}
		ln, err := s.listenOn(l.what, "tcp", l.addr)
		if err != nil {
			s.closeListeners()
			return fmt.Errorf("%s server: %w", l.what, err)
		}
		*l.ln = ln
	}
	return nil
}

// listenHealthCheck is the healthCheckNodePort servers' Listen: a handed-over socket for the
// address when there is one.
func (s *servers) listenHealthCheck(network, address string) (net.Listener, error) {
	return s.listenOn("healthcheck "+healthcheck.ListenKey(network, address), network, address)
}

// listenOn returns the inherited socket of key when its address is address, or a new listener.
func (s *servers) listenOn(key, network, address string) (net.Listener, error) {
	s.mu.Lock()
	f := s.inherited[key]
	delete(s.inherited, key)
	s.mu.Unlock()
	if f != nil {
		ln, err := net.FileListener(f)
		f.Close()
		if err == nil && sameAddr(ln.Addr(), address) {
			s.log.Info().Str("address", address).Str("server", key).Msg("serving on the socket the predecessor handed over")
			return ln, nil
		}
		if ln != nil {
			ln.Close()
		}
	}
	return net.Listen(network, address)
}

// sameAddr reports whether a listener's address is what address (host:port) asks for. For
// 0.0.0.0 Go listens on [::] (both families) where the machine has IPv6, so a socket of either
// unspecified address is what 0.0.0.0 asks for.
func sameAddr(a net.Addr, address string) bool {
	host, port, err := net.SplitHostPort(address)
	ta, ok := a.(*net.TCPAddr)
	if err != nil || !ok || strconv.Itoa(ta.Port) != port {
		return false
	}
	if host == "" {
		return ta.IP.IsUnspecified()
	}
	ip := net.ParseIP(host)
	if ip.Equal(net.IPv4zero) {
		return ta.IP.IsUnspecified()
	}
	return ip != nil && ip.Equal(ta.IP)
}

// handoverRecords returns duplicates of every server's listening socket, for a successor.
func (s *servers) handoverRecords() ([]handover.Record, error) {
	files := map[string]*os.File{}
	for _, l := range []struct {
		ln   net.Listener
		what string
	}{{s.healthzLn, "healthz"}, {s.metricsLn, "metrics"}} {
		if tl, ok := l.ln.(*net.TCPListener); ok {
			f, err := tl.File()
			if err != nil {
				return nil, fmt.Errorf("%s server: %w", l.what, err)
			}
			files[l.what] = f
		}
	}
	hc, err := s.services.ListenerFiles()
	if err != nil {
		for _, f := range files {
			f.Close()
		}
		return nil, err
	}
	for k, f := range hc {
		files["healthcheck "+k] = f
	}
	var recs []handover.Record
	for k, f := range files {
		r, err := handover.NewRecord(handover.KindServer, k, f)
		if err != nil {
			f.Close()
			continue
		}
		recs = append(recs, r)
	}
	return recs, nil
}

// inheritedServers takes the server sockets out of a hand-over package, by name ("healthz", "metrics", "healthcheck <network> <address>").
func inheritedServers(pkg *handover.Package) map[string]*os.File {
	out := map[string]*os.File{}
	if pkg == nil {
		return out
	}
	for i := range pkg.Records {
		r := &pkg.Records[i]
		var key string
		if r.Kind != handover.KindServer || len(r.Files) != 1 || json.Unmarshal(r.Meta, &key) != nil {
			continue
		}
		out[key] = r.Files[0]
		r.Files = nil
	}
	return out
}

// healthCheckAddrs returns where healthCheckNodePort servers listen: where NodePorts are
// served (portal.NodePortListenAddrs) on this node's current addresses.
func healthCheckAddrs(prefixes []netip.Prefix) ([]netip.Addr, error) {
	node, err := proxy.ListNodeAddrs()
	if err != nil {
		return nil, fmt.Errorf("health check addresses: %w", err)
	}
	addrs, err := portal.NodePortListenAddrs(prefixes, node.List())
	if err != nil {
		return nil, fmt.Errorf("health check addresses: %w", err)
	}
	return addrs, nil
}

// queued tells the servers that a change is waiting for the next sync.
func (s *servers) queued(at time.Time) {
	s.metrics.Queued(at)
	s.health.Queued(at)
}

// synced hands a sync's result to every server.
func (s *servers) synced(r proxy.SyncResult) {
	s.metrics.Synced(r)
	s.health.Synced(r)
	s.services.Synced(r)
	// The first sync has opened every health check server that is still wanted: a socket handed
	// over for one that is not would otherwise accept connections nobody answers.
	s.dropInherited.Do(func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		for k, f := range s.inherited {
			f.Close()
			delete(s.inherited, k)
		}
	})
}

// run serves /healthz and /metrics until ctx is done, then stops every server (the
// healthCheckNodePort ones too) and returns.
func (s *servers) run(ctx context.Context) {
	var hs []*httpserve.Server
	serve := func(ln net.Listener, h http.Handler, what string) {
		if ln == nil {
			return
		}
		s.log.Info().Str("address", ln.Addr().String()).Msg("serving " + what)
		log := s.log.With().Str("server", what).Logger()
		hs = append(hs, httpserve.Serve(ln, httpserve.Options{Handler: h, Limits: serverLimits, Log: log}))
	}
	serve(s.healthzLn, s.health.Handler(), "healthz")
	mux := http.NewServeMux()
	mux.Handle("/metrics", s.metrics.Handler())
	mux.HandleFunc("/proxyMode", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		fmt.Fprint(w, ProxyMode)
	})
	if s.profiling {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	serve(s.metricsLn, mux, "metrics")

	<-ctx.Done()
	if s.handedOver.Load() {
		// The successor serves on the same sockets: stop accepting on them all at once and
		// finish the requests already accepted, rather than cutting them.
		sctx, cancel := context.WithTimeout(context.Background(), handoverDrain)
		defer cancel()
		err := errors.Join(httpserve.ShutdownAll(sctx, hs...), s.services.Shutdown(sctx))
		if err != nil {
			s.log.Warn().Err(err).Msg("finishing the requests in progress after the hand-over")
		}
		return
	}
	for _, srv := range hs {
		if err := srv.Close(); err != nil {
			s.log.Warn().Err(err).Msg("closing a server")
		}
	}
	s.services.Close()
}

// handoverDrain bounds how long the servers of a proxy that handed over finish the requests
// they accepted before letting go.
const handoverDrain = 5 * time.Second

func (s *servers) closeListeners() {
	s.mu.Lock()
	for k, f := range s.inherited {
		f.Close()
		delete(s.inherited, k)
	}
	s.mu.Unlock()
	for _, ln := range []net.Listener{s.healthzLn, s.metricsLn} {
		if ln != nil {
			_ = ln.Close()
		}
	}
}
