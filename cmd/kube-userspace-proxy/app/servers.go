package app

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/metrics"
)

// ProxyMode is what /proxyMode on the metrics server answers (kube-proxy answers its mode there).
const ProxyMode = "userspace"

// servers are the proxy's HTTP servers and the sync observers that feed them: /healthz and
// /livez, /metrics and /proxyMode, and the healthCheckNodePort servers.
type servers struct {
	log      zerolog.Logger
	metrics  *metrics.Metrics
	health   *healthcheck.ProxyHealth
	services *healthcheck.Services

	healthzAddr, metricsAddr string
	// Listeners opened by newServers, so bind errors are reported at startup; nil when disabled.
	healthzLn, metricsLn net.Listener
}

// newServers builds the servers and opens the /healthz and /metrics listeners (empty addresses
// disable them).
func newServers(opts *Options, v *Validated, health healthcheck.ProxyHealthOptions, log zerolog.Logger) (*servers, error) {
	s := &servers{
		log:         log,
		metrics:     metrics.New(metrics.Options{}),
		health:      healthcheck.NewProxyHealth(health),
		healthzAddr: opts.HealthzBindAddress,
		metricsAddr: opts.MetricsBindAddress,
	}
	addrs, err := healthCheckAddrs(v.NodePortAddresses)
	if err != nil {
		return nil, err
	}
	s.services = healthcheck.NewServices(healthcheck.ServicesOptions{
		Log:    log.With().Str("component", "healthcheck").Logger(),
		Addrs:  addrs,
		Health: s.health,
	})
	for _, l := range []struct {
		addr string
		ln   *net.Listener
		what string
	}{{s.healthzAddr, &s.healthzLn, "healthz"}, {s.metricsAddr, &s.metricsLn, "metrics"}} {
		if l.addr == "" {
			continue
		}
		ln, err := net.Listen("tcp", l.addr)
		if err != nil {
			s.closeListeners()
			return nil, fmt.Errorf("%s server: %w", l.what, err)
		}
		*l.ln = ln
	}
	return s, nil
}

// healthCheckAddrs returns where healthCheckNodePort servers listen: nil (every address) without
// --nodeport-addresses, else the node's addresses inside the prefixes (an unspecified address
// for a family whose prefix is /0).
func healthCheckAddrs(prefixes []netip.Prefix) ([]netip.Addr, error) {
	if len(prefixes) == 0 {
		return nil, nil
	}
	local, err := portal.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("health check addresses: %w", err)
	}
	var out []netip.Addr
	for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		hasFamily := false
		for _, p := range prefixes {
			hasFamily = hasFamily || p.Addr().Unmap().Is4() == (fam == iptables.IPv4)
		}
		if !hasFamily {
			continue
		}
		ips, all := portal.NodePortIPs(fam, prefixes, local)
		if all {
			if fam == iptables.IPv4 {
				out = append(out, netip.IPv4Unspecified())
			} else {
				out = append(out, netip.IPv6Unspecified())
			}
			continue
		}
		out = append(out, ips...)
	}
	if len(out) == 0 {
		return nil, errors.New("health check addresses: no node address matches --nodeport-addresses")
	}
	return out, nil
}

// observer returns the proxy.SyncObserver feeding every server.
func (s *servers) observer() proxy.SyncObserver {
	return observers{s.metrics, s.health, s.services}
}

// run serves /healthz and /metrics until ctx is done, then stops every server (the
// healthCheckNodePort ones too) and returns.
func (s *servers) run(ctx context.Context) {
	var wg sync.WaitGroup
	var hs []*http.Server
	serve := func(ln net.Listener, h http.Handler, what string) {
		if ln == nil {
			return
		}
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		hs = append(hs, srv)
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.log.Info().Str("address", ln.Addr().String()).Msg("serving " + what)
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				s.log.Error().Err(err).Msg(what + " server stopped")
			}
		}()
	}
	serve(s.healthzLn, s.health.Handler(), "healthz")
	mux := http.NewServeMux()
	mux.Handle("/metrics", s.metrics.Handler())
	mux.HandleFunc("/proxyMode", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		fmt.Fprint(w, ProxyMode)
	})
	serve(s.metricsLn, mux, "metrics")

	<-ctx.Done()
	for _, srv := range hs {
		_ = srv.Close()
	}
	wg.Wait()
	s.services.Close()
}

func (s *servers) closeListeners() {
	for _, ln := range []net.Listener{s.healthzLn, s.metricsLn} {
		if ln != nil {
			_ = ln.Close()
		}
	}
}

// observers fans one proxy.SyncObserver out to several, including the optional
// proxy.ChangeCounter and proxy.SyncModeObserver.
type observers []proxy.SyncObserver

var (
	_ proxy.ChangeCounter    = observers(nil)
	_ proxy.SyncModeObserver = observers(nil)
)

func (o observers) SyncDone(start time.Time, took time.Duration, oldest time.Time, err error) {
	for _, ob := range o {
		ob.SyncDone(start, took, oldest, err)
	}
}

func (o observers) ChangeQueued(at time.Time) {
	for _, ob := range o {
		ob.ChangeQueued(at)
	}
}

func (o observers) PortsSynced(ports []proxy.PortState) {
	for _, ob := range o {
		ob.PortsSynced(ports)
	}
}

func (o observers) SyncModeDone(full bool, took time.Duration) {
	for _, ob := range o {
		if sm, ok := ob.(proxy.SyncModeObserver); ok {
			sm.SyncModeDone(full, took)
		}
	}
}

func (o observers) ChangesApplied(services, endpoints int) {
	for _, ob := range o {
		if cc, ok := ob.(proxy.ChangeCounter); ok {
			cc.ChangesApplied(services, endpoints)
		}
	}
}
