// Package app wires kube-userspace-proxy together: it parses and validates the options, builds
// the source, the proxier, the portals and the servers, and runs them until a signal.
package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/debug"
	"time"

	"github.com/rs/zerolog"
	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source/kubeapi"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source/manifests"
)

// Main parses args and runs the proxy; it returns the process exit code.
func Main(args []string, stdout, stderr io.Writer) int {
	opts := NewOptions()
	fs := pflag.NewFlagSet("kube-userspace-proxy", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	opts.AddFlags(fs)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return 0
		}
		return 2
	}
	if opts.Version {
		fmt.Fprintln(stdout, versionLine(Version, Commit, debug.ReadBuildInfo))
		return 0
	}
	if err := opts.Complete(fs); err != nil {
		fmt.Fprintf(stderr, "invalid configuration: %v\n", err)
		return 2
	}
	v, err := opts.Validate()
	if err != nil {
		fmt.Fprintf(stderr, "invalid options:\n%v\n", err)
		return 2
	}
	if opts.WriteConfigTo != "" {
		if err := opts.WriteConfigFile(opts.WriteConfigTo, stdout); err != nil {
			fmt.Fprintf(stderr, "%v\n", err)
			return 1
		}
		return 0
	}
	level, _ := parseLevel(opts.LogLevel)
	log := zerolog.New(zerolog.ConsoleWriter{Out: stderr, TimeFormat: time.RFC3339, NoColor: !isTerminal(stderr)}).Level(level).With().Timestamp().Logger()
	routeKlog(log)

	for _, w := range opts.ConfigWarnings {
		log.Warn().Str("config", opts.ConfigFile).Msg(w)
	}

	ctx, stop := signalContext(context.Background(), log, os.Exit)
	defer stop()
	if err := Run(ctx, opts, v, log); err != nil {
		log.Error().Err(err).Msg("exiting")
		return 1
	}
	return 0
}

// Run runs the proxy until ctx is done (or the source fails), then shuts it down at once: stop
// accepting, remove the portals, drain for up to the grace period. Only then does it wait for the
// source, at most sourceStopTimeout: if the source has not stopped by then (client-go sleeping
// out a back-off), Run returns without it and the source's goroutine is abandoned, to end with
// the process. Run is meant to be called once per process, from Main.
func Run(ctx context.Context, opts *Options, v *Validated, log zerolog.Logger) error {
	if opts.Cleanup {
		if err := cleanupPortals(ctx, log); err != nil {
			return fmt.Errorf("cleanup: %w", err)
		}
		log.Info().Msg("removed every rule and chain of ours")
		return nil
	}
	if n, err := forward.RaiseFileLimit(); err != nil {
		log.Warn().Err(err).Msg("cannot raise RLIMIT_NOFILE")
	} else {
		log.Debug().Uint64("limit", n).Msg("RLIMIT_NOFILE")
	}
	if err := setOOMScoreAdj(oomScoreAdjPath, opts.OOMScoreAdj); err != nil {
		log.Warn().Err(err).Msg("cannot set the OOM score adjustment")
	}
	ct := conntrackSysctls{procRoot: "/proc", sysRoot: "/sys", log: log.With().Str("component", "conntrack").Logger()}
	for _, err := range ct.apply(opts.conntrackSettings(runtime.NumCPU())) {
		log.Warn().Err(err).Msg("conntrack sysctl left alone")
	}

	src, err := newSource(opts, v, log)
	if err != nil {
		return err
	}

	pOpts := proxy.Options{
		Log:           log.With().Str("component", "proxier").Logger(),
		NodeName:      v.NodeName,
		BindAddress:   v.BindAddress,
		PortRange:     v.PortRange,
		UDPTimeout:    opts.UDPTimeout,
		MinSyncPeriod: opts.MinSyncPeriod,
		SyncPeriod:    opts.SyncPeriod,
		ClusterCIDRs:  v.ClusterCIDRs,
	}
	var portals *portalSet
	if opts.PortalMode == PortalModeIPTables {
		portals, err = newPortals(ctx, v, log.With().Str("component", "portal").Logger())
		if err != nil {
			return err
		}
		pOpts.Portals = portals
		pOpts.HoldPorts = true
		if opts.TransparentLocal {
			pOpts.TransparentLocal = enableTransparent(ctx, portals, log)
		}
	}
	health := healthcheck.ProxyHealthOptions{Timeout: 2 * opts.SyncPeriod}
	if e, ok := src.(interface{ Err() error }); ok {
		health.SourceErr = e.Err // the API server source: /healthz reports an outage
	}
	if n, ok := src.(interface{ NodeEligible() bool }); ok {
		health.NodeEligible = n.NodeEligible // and drains the node while it is being removed
	}
	srv, err := newServers(opts, v, health, log.With().Str("component", "servers").Logger())
	if err != nil {
		return err
	}
	pOpts.Observer, pOpts.Metrics = srv.observer(), srv.metrics
	px := proxy.New(pOpts)
	log.Info().Str("node", v.NodeName).Str("portalMode", opts.PortalMode).Str("proxyPortRange", v.PortRange.String()).
		Str("version", Version).Msg("starting kube-userspace-proxy")

	proxyCtx, stopProxy := context.WithCancel(context.Background())
	defer stopProxy()
	// The source runs until ctx is done; it is stopped (and waited for, bounded) after the proxy
	// has shut down, so that a source slow to stop never delays the shutdown.
	srcCtx, stopSource := context.WithCancel(ctx)
	defer stopSource()
	srcDone := make(chan error, 1)
	go func() { srcDone <- src.Run(srcCtx, px.Tracker()) }()
	proxyDone := make(chan struct{})
	go func() { px.Run(proxyCtx); close(proxyDone) }()
	// The health, metrics and health check node port servers run until the drain is over.
	serversCtx, stopServers := context.WithCancel(context.Background())
	serversDone := make(chan struct{})
	go func() { srv.run(serversCtx); close(serversDone) }()
	defer func() { stopServers(); <-serversDone }()

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-srcDone: // the source failed (or ended) on its own
		srcDone = nil
		if runErr != nil {
			runErr = fmt.Errorf("source: %w", runErr)
		}
	}
	stopSource()
	// Shutdown: stop accepting, remove portals, let connections finish, exit.
	stopProxy()
	<-proxyDone
	log.Info().Msg("stopped accepting; removing portals")
	if portals != nil {
		if cerr := portals.Cleanup(context.Background()); cerr != nil {
			log.Error().Err(cerr).Msg("removing portals")
		}
	}
	sctx, cancel := context.WithTimeout(context.Background(), opts.ShutdownGracePeriod)
	defer cancel()
	if serr := px.Shutdown(sctx); serr != nil {
		log.Warn().Err(serr).Msg("connections cut at the end of the grace period")
	}
	if portals != nil { // after the drain: transparent connections need their reply routing
		if cerr := portals.CleanupTransparent(context.Background()); cerr != nil {
			log.Error().Err(cerr).Msg("removing the routing of transparent connections")
		}
	}
	if srcDone != nil {
		if serr := waitSource(srcDone, sourceStopTimeout, log); serr != nil && runErr == nil {
			runErr = fmt.Errorf("source: %w", serr)
		}
	}
	if runErr != nil && !errors.Is(runErr, context.Canceled) {
		return runErr
	}
	return nil
}

// sourceStopTimeout bounds how long Run waits for the source once the proxy has shut down.
// client-go's reflector sleeps out its back-off (up to a minute while the API server is
// unreachable) without watching for cancellation, and the API server source waits for its
// informers.
const sourceStopTimeout = 5 * time.Second

// waitSource waits up to timeout for the source's Run to return on done, and returns its error.
// When it does not return in time, waitSource logs so and returns nil: the source's goroutine
// (stuck in client-go's back-off sleep) is abandoned. That only happens at the end of the
// process, which exits right after Run and takes the goroutine with it; the proxy no longer
// syncs, so what the source still delivers has no effect.
func waitSource(done <-chan error, timeout time.Duration, log zerolog.Logger) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case err := <-done:
		log.Debug().Msg("source stopped")
		return err
	case <-t.C:
		log.Warn().Dur("waited", timeout).Msg("the source has not stopped (client-go's back-off ignores cancellation); exiting without it")
		return nil
	}
}

// runner is what Run needs of a source.
type runner interface {
	Run(ctx context.Context, h source.Handler) error
}

func newSource(opts *Options, v *Validated, log zerolog.Logger) (runner, error) {
	if opts.Manifests != "" {
		return manifests.New(opts.Manifests, manifests.Options{
			ServiceCIDRs: v.ServiceCIDRs,
			Log:          log.With().Str("component", "manifests").Logger(),
		}), nil
	}
	cfg, err := kubeapi.BuildConfig(opts.Kubeconfig, opts.Master)
	if err != nil {
		return nil, fmt.Errorf("API server configuration: %w", err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("API client for %s: %w", cfg.Host, err)
	}
	return kubeapi.New(client, kubeapi.Options{Log: log.With().Str("component", "kubeapi").Logger(), NodeName: v.NodeName}), nil
}

func parseLevel(s string) (zerolog.Level, error) {
	switch s {
	case "debug", "info", "warn", "error":
		return zerolog.ParseLevel(s)
	}
	return zerolog.NoLevel, fmt.Errorf("unknown level %q (want debug, info, warn or error)", s)
}

// isTerminal reports whether w is a character device (a terminal): logs are coloured only there.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
