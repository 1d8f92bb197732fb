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
	"sync"
	"time"

	"github.com/rs/zerolog"
	"github.com/spf13/pflag"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/events"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source/kubeapi"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source/manifests"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/userspace"
)

// Main parses args and runs the proxy; it returns the process exit code.
func Main(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == HoldCommand {
		return holdMain(args[1:], stderr)
	}
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
	if opts.ProbeReady {
		return probeMain(opts, stdout)
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
	// Milliseconds: a start, a sync or a hand-over takes less than a second.
	zerolog.TimeFieldFormat = time.RFC3339Nano
	log := zerolog.New(zerolog.ConsoleWriter{Out: stderr, TimeFormat: logTimeFormat, NoColor: !isTerminal(stderr)}).Level(level).With().Timestamp().Logger()
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

// portalSetOptions is what the portals take from the options; successor is portal.SetOptions'.
func portalSetOptions(opts *Options, v *Validated, successor bool, log zerolog.Logger) portal.SetOptions {
	return portal.SetOptions{
		BindAddress:          v.BindAddress,
		NodePortAddresses:    v.NodePortAddresses,
		ClusterCIDRs:         v.ClusterCIDRs,
		NoLocalhostNodePorts: !opts.LocalhostNodePorts,
		Log:                  log,
		Successor:            successor,
	}
}

// logTimeFormat is the log's time stamp: RFC 3339 with milliseconds.
const logTimeFormat = "2006-01-02T15:04:05.000Z07:00"

// Run runs the proxy until ctx is done (or the source fails), then shuts it down at once: stop
// accepting, remove the portals, drain for up to the grace period. Only then does it wait for the
// source, at most sourceStopTimeout: if the source has not stopped by then (client-go sleeping
// out a back-off), Run returns without it and the source's goroutine is abandoned, to end with
// the process. Run is meant to be called once per process, from Main.
func Run(ctx context.Context, opts *Options, v *Validated, log zerolog.Logger) error {
	if opts.Cleanup {
		if err := portal.CleanupAll(ctx, log); err != nil {
			return fmt.Errorf("cleanup: %w", err)
		}
		log.Info().Msg("removed every rule and chain of ours")
		return nil
	}
	if opts.ConntrackOnly {
		setConntrack(opts, log)
		return nil
	}
	if opts.Profiling && runtime.MemProfileRate == 0 {
		runtime.MemProfileRate = defaultMemProfileRate // main turned sampling off until now
	}
	fileLimit, err := forward.RaiseFileLimit()
	if err != nil {
		log.Warn().Err(err).Msg("cannot raise RLIMIT_NOFILE")
	}
	limits := userspace.Limits{
		FileLimit:          int(min(fileLimit, 1<<30)),
		Reserve:            opts.FDReserve,
		MaxConnsPerPort:    opts.MaxConnectionsPerPort,
		MaxSessionsPerPort: opts.MaxUDPSessionsPerPort,
		MaxAffinityEntries: opts.MaxAffinityEntries,
		TCPIdleTimeout:     opts.TCPIdleTimeout,
	}
	log.Info().Uint64("openFilesLimit", fileLimit).Int("reserve", limits.ReserveFDs()).
		Int("maxConnectionsPerPort", limits.ConnsPerPort()).Int("maxUDPSessionsPerPort", limits.SessionsPerPort()).
		Msg("descriptor budget of the data path")
	if oomScoreAdjPath == "" {
		log.Debug().Msg("--oom-score-adj ignored: not supported on this OS")
	} else if err := setOOMScoreAdj(oomScoreAdjPath, opts.OOMScoreAdj); err != nil {
		log.Warn().Err(err).Msg("cannot set the OOM score adjustment")
	}
	setConntrack(opts, log)

	src, status, rec, err := newSource(opts, v, log)
	if err != nil {
		return err
	}
	// Events are written from their own goroutine, never waited for by a sync.
	eventsCtx, stopEvents := context.WithCancel(context.Background())
	eventsDone := make(chan struct{})
	go func() { defer close(eventsDone); rec.Run(eventsCtx) }()
	defer func() { stopEvents(); <-eventsDone }()

	pOpts := userspace.Options{
		Log:           log.With().Str("component", "proxier").Logger(),
		NodeName:      v.NodeName,
		BindAddress:   v.BindAddress,
		PortRange:     v.PortRange,
		UDPTimeout:    opts.UDPTimeout,
		MinSyncPeriod: opts.MinSyncPeriod,
		SyncPeriod:    opts.SyncPeriod,
		ClusterCIDRs:  v.ClusterCIDRs,
		Limits:        limits,
	}
	if rec != nil {
		pOpts.OnProblem = rec.Problem
	}
	var portals *portal.Set
	var lock *instanceLock // held while this proxy programs the portals
	hoPath, successor := "", false
	if opts.PortalMode == PortalModeIPTables {
		if hoPath, err = handoverSocket(opts); err != nil {
			return err
		}
		// Before any rule is touched: a second proxy must not remove the running one's portals.
		// With a hand-over socket it prepares to take over instead (nothing it does before
		// that writes a rule or binds a port the running one holds).
		var err error
		lock, err = lockInstance(InstanceLockDir)
		switch {
		case errors.Is(err, errInstanceRunning) && hoPath != "":
			successor = true
			log.Info().Err(err).Str("socket", hoPath).Msg("another proxy serves this node: preparing to take over")
		case err != nil:
			return err
		}
		defer func() { lock.release() }()
		portals, err = portal.NewSet(ctx, portalSetOptions(opts, v, successor, log.With().Str("component", "portal").Logger()))
		if err != nil {
			return err
		}
		pOpts.Portals = portals
		pOpts.PreferredPorts = survivingPorts(ctx, portals, log)
		pOpts.HoldPorts = true
	}
	// Names this process while it serves the node, for --probe-ready.
	ready := newReadyFile(opts.ReadyFile, "/proc", log.With().Str("component", "ready").Logger())
	defer ready.stop()
	health := healthcheck.ProxyHealthOptions{Timeout: 2 * opts.SyncPeriod, Source: status}
	srv, err := newServers(opts, v, health, log.With().Str("component", "servers").Logger())
	if err != nil {
		return err
	}
	// The API client's requests, as kube-proxy exposes them (rest_client_*): client-go takes
	// one set of request metrics per process.
	if err := srv.metrics.RegisterRESTClient(); err != nil {
		log.Warn().Err(err).Msg("the API client's request metrics are not on /metrics")
	}
	firstSync := make(chan struct{})
	var firstSyncOnce sync.Once
	var kp *keeper // set before the proxier runs
	pOpts.OnQueued, pOpts.Metrics, pOpts.OnEndpointsProgrammed = srv.queued, srv.metrics, srv.metrics.EndpointsProgrammed
	pOpts.OnSynced = func(r proxy.SyncResult) {
		srv.synced(r)
		firstSyncOnce.Do(func() { close(firstSync); ready.markSynced() })
		if kp != nil {
			kp.synced()
		}
	}
	px := userspace.New(pOpts)
	if opts.HolderSocket != "" {
		kp = newKeeper(opts.HolderSocket, px, log.With().Str("component", "holder").Logger())
	}
	if b := px.Budget(); b != nil {
		srv.metrics.WatchBudget(b)
	}
	log.Info().Str("node", v.NodeName).Str("portalMode", opts.PortalMode).Str("proxyPortRange", v.PortRange.String()).
		Str("version", Version).Msg("starting kube-userspace-proxy")

	// The source runs until ctx is done; it is stopped (and waited for, bounded) after the proxy
	// has shut down, so that a source slow to stop never delays the shutdown.
	srcCtx, stopSource := context.WithCancel(ctx)
	defer stopSource()
	srcDone := make(chan error, 1)
	go func() { srcDone <- src.Run(srcCtx, px.Tracker()) }()

	var pkg *handover.Package
	if successor {
		var l *instanceLock
		pkg, l, err = takeOver(ctx, hoPath, px, portals, srv.metrics, log.With().Str("component", "handover").Logger())
		if err != nil {
			stopSource()
			_ = waitSource(srcDone, sourceStopTimeout, log)
			return err
		}
		lock = l
	}
	if pkg == nil && kp != nil {
		// Not a hand-over (which takes precedence): a crash may have left listening sockets
		// in the holder, with connections queued on them.
		kp.adopt(ctx)
	}
	err = srv.listen(inheritedServers(pkg))
	pkg.Close() // what neither the proxier nor the servers took
	if err != nil {
		return err
	}
	rec.NodeStarted(v.NodeName) // as kube-proxy, once its servers are up

	proxyCtx, stopProxy := context.WithCancel(context.Background())
	defer stopProxy()
	proxyDone := make(chan struct{})
	go func() { px.Run(proxyCtx); close(proxyDone) }()
	// Transparent connections for Local services need reply routing, programmed after the first
	// sync: a restart serves on the surviving rules first. Until then (a few hundred
	// milliseconds) such connections are dialled from the node's address.
	transparentDone := make(chan struct{})
	go func() {
		defer close(transparentDone)
		if portals == nil || !opts.TransparentLocal {
			return
		}
		select {
		case <-firstSync:
		case <-proxyCtx.Done():
			return
		}
		if portals.TryTransparent(ctx) {
			px.SetTransparentLocal(true)
		}
	}()
	// The initial state's decoding and first sync allocate several times what stays live (at
	// 10,000 services ~450 MB for a 70 MB heap): give the pages back once, after the first
	// sync, rather than holding them until the scavenger gets to them. Its own goroutine: with
	// a large heap it takes most of a second, which the next sync should not wait for. From
	// then on the collector runs at steadyGCPercent (see there).
	memDone := make(chan struct{})
	go func() {
		defer close(memDone)
		select {
		case <-firstSync:
			if gc, set := steadyGC(); set {
				log.Debug().Int("gcPercent", gc).Msg("garbage collection target from now on")
			}
			debug.FreeOSMemory()
		case <-proxyCtx.Done():
		}
	}()
	defer func() { stopProxy(); <-memDone }() // stopProxy first: defers run last-in first-out
	// The health, metrics and health check node port servers run until the drain is over.
	serversCtx, stopServers := context.WithCancel(context.Background())
	serversDone := make(chan struct{})
	go func() { srv.run(serversCtx); close(serversDone) }()
	defer func() { stopServers(); <-serversDone }()

	// The holder follows the proxier's listeners until the proxy hands over or stops; then it
	// is emptied (the successor's holder keeps them, or the rules are gone).
	keeperDone := make(chan struct{})
	keeperCtx, stopKeeper := context.WithCancel(context.Background())
	defer stopKeeper()
	if kp != nil {
		go func() { defer close(keeperDone); kp.run(keeperCtx) }()
	} else {
		close(keeperDone)
	}
	endKeeper := func() {
		stopKeeper()
		<-keeperDone
		if kp != nil {
			kp.clear()
		}
	}

	handedOver := make(chan struct{})
	var stopHandovers func() bool
	if hoPath != "" {
		g := &giver{px: px, srv: srv, portals: portals, lock: lock, ready: ready}
		stop, err := serveHandovers(ctx, hoPath, g, handedOver, log.With().Str("component", "handover").Logger())
		if err != nil {
			log.Warn().Err(err).Msg("no hand-over socket: a successor will restart instead of taking over")
		} else {
			stopHandovers = stop
			defer stop()
		}
	}

	var runErr error
	handed := false
	select {
	case <-ctx.Done():
	case runErr = <-srcDone: // the source failed (or ended) on its own
		srcDone = nil
		if runErr != nil {
			runErr = fmt.Errorf("source: %w", runErr)
		}
	case <-handedOver:
		handed = true
	}
	// Handed over or shutting down, this process serves the node no more: its pod turns not
	// ready, whatever an exchange still under way decides.
	ready.stop()
	// An exchange under way when the signal (or the source's end) came is finished first
	// (within handoverTimeout; its freeze gives up dials still in progress), and it decides:
	// handed over, everything is the successor's and no portal may be removed; failed, the
	// proxier serves again and shuts down as usual. No new exchange begins.
	if !handed && stopHandovers != nil {
		handed = stopHandovers()
	}
	endKeeper()
	if handed {
		// The servers' sockets are the successor's now: stop accepting on them at once, and
		// finish what they accepted.
		srv.handedOver.Store(true)
		stopServers()
	}
	stopSource()
	stopProxy()
	<-proxyDone
	<-transparentDone
	if handed {
		// Everything lives on in the successor: no portal is removed, no connection cut.
		<-serversDone
		if !opts.HandoverExit && ctx.Err() == nil {
			log.Info().Msg("handed over to the successor; waiting for SIGTERM, serving nothing (--handover-exit=false)")
			<-ctx.Done()
		}
		log.Info().Msg("handed over to the successor; exiting")
		if srcDone != nil {
			_ = waitSource(srcDone, sourceStopTimeout, log)
		}
		return nil
	}
	// Shutdown: stop accepting, remove portals, let connections finish, exit.
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

// newSource builds the source the options name, what /healthz reports of it, and the recorder
// of the proxy's Events (both nil for a manifests directory, which has no API server).
func newSource(opts *Options, v *Validated, log zerolog.Logger) (runner, healthcheck.SourceStatus, *events.Recorder, error) {
	if opts.Manifests != "" {
		return manifests.New(opts.Manifests, manifests.Options{
			ServiceCIDRs: v.ServiceCIDRs,
			Log:          log.With().Str("component", "manifests").Logger(),
		}), nil, nil, nil
	}
	cfg, err := kubeapi.BuildConfig(opts.Kubeconfig, opts.Master)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("API server configuration: %w", err)
	}
	client, err := kubeapi.NewClient(cfg)
	if err != nil {
		return nil, nil, nil, err
	}
	sink, err := events.NewRESTSink(cfg)
	if err != nil {
		return nil, nil, nil, err
	}
	rec := events.New(events.Options{Sink: sink, Log: log.With().Str("component", "events").Logger()})
	src := kubeapi.New(client, kubeapi.Options{Log: log.With().Str("component", "kubeapi").Logger(), NodeName: v.NodeName})
	return src, src, rec, nil
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

// steadyGCPercent is the collector's target (GOGC) once the first sync is done, unless the
// GOGC environment variable sets one. After the start the heap is nearly all long-lived state
// (listeners, rules, the sources' objects: ~48 MiB live at 10,000 service ports from the API
// server) and a sync's garbage is small, but Go's default of 100 lets that garbage pile up to
// the size of the live heap before a collection, and RSS follows it there over time (an idle
// proxy at 10,000 reached that goal in ~20 minutes in a scale measurement). At 50 the
// heap stays within 1.5 times the live one; the cost is a collection per ~24 MiB allocated
// instead of ~48: a few a minute while services churn, about none when idle (the runtime
// collects every two minutes anyway).
const steadyGCPercent = 50

// steadyGC sets the collector's target to steadyGCPercent unless GOGC is set, and returns the
// target and whether it set it.
func steadyGC() (int, bool) {
	if _, ok := os.LookupEnv("GOGC"); ok {
		return 0, false
	}
	debug.SetGCPercent(steadyGCPercent)
	return steadyGCPercent, true
}

// defaultMemProfileRate is the Go runtime's default allocation sampling rate (runtime.MemProfileRate),
// restored when profiles are served: the command's main turns sampling off.
const defaultMemProfileRate = 512 * 1024
