package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/metrics"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/userspace"
)

// HandoverNone as --handover-socket turns hand-overs off: a proxy started while another runs
// exits, and this one answers no successor.
const HandoverNone = "none"

// handoverTimeout bounds one hand-over exchange, from hello to released.
const handoverTimeout = 30 * time.Second

// handoverSocket returns the hand-over socket's path: --handover-socket, or this network
// namespace's socket in InstanceLockDir; "" when hand-overs are off.
func handoverSocket(opts *Options) (string, error) {
	switch opts.HandoverSocket {
	case HandoverNone:
		return "", nil
	case "":
		return handover.Path(InstanceLockDir)
	}
	return opts.HandoverSocket, nil
}

// onceFunc makes a release function safe to call more than once.
func onceFunc(f func()) func() {
	var once sync.Once
	return func() { once.Do(f) }
}

// takeOver is a successor's start: once its source has delivered the initial state (so that it
// can serve at once), it asks the running proxy for everything and adopts it. When the running
// proxy refuses or the hand-over fails, it falls back to a restart: it waits for the running
// proxy to exit (its instance lock to be free). It returns the package (what the proxier did not
// adopt is the caller's: the servers' sockets) and the instance lock's release.
func takeOver(ctx context.Context, path string, px *userspace.Proxier, portals *portal.Set, m *metrics.Metrics, log zerolog.Logger) (*handover.Package, func(), error) {
	select {
	case <-px.Synced():
	case <-ctx.Done():
		return nil, nil, ctx.Err()
	}
	var release func()
	claim := func() error {
		r, err := lockInstance(InstanceLockDir)
		if err == nil {
			release = onceFunc(r)
		}
		return err
	}
	tctx, cancel := context.WithTimeout(ctx, handoverTimeout)
	began := time.Now()
	pkg, err := handover.Take(tctx, path, Version, claim, log)
	took := time.Since(began)
	cancel()
	if err == nil {
		m.Handover(metrics.HandoverSuccessor, metrics.HandoverCompleted, took, recordKinds(pkg.Records))
		log.Info().Dur("took", took).Interface("records", recordKinds(pkg.Records)).Msg("took over from the running proxy")
		px.Adopt(pkg.Records)
		adoptFlowTargets(pkg, portals, log)
		return pkg, release, nil
	}
	if release != nil { // claimed, yet Take failed: cannot happen, but never hold the lock twice
		release()
	}
	what, result := "hand-over failed", metrics.HandoverFailed
	if errors.Is(err, handover.ErrRefused) {
		what, result = "hand-over refused", metrics.HandoverRefused
	}
	m.Handover(metrics.HandoverSuccessor, result, took, nil)
	log.Warn().Err(err).Msg(what + "; falling back to a restart: waiting for the running proxy to exit")
	release, err = waitForLock(ctx, log)
	return nil, release, err
}

// waitForLock takes the instance lock once the running proxy frees it, or fails when ctx ends.
func waitForLock(ctx context.Context, log zerolog.Logger) (func(), error) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	logged := time.Now()
	for {
		release, err := lockInstance(InstanceLockDir)
		if err == nil {
			log.Info().Msg("the running proxy exited; starting")
			return onceFunc(release), nil
		}
		if !errors.Is(err, errInstanceRunning) {
			return nil, err
		}
		if time.Since(logged) > time.Minute {
			log.Info().Err(err).Msg("still waiting for the running proxy to exit")
			logged = time.Now()
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for the running proxy to exit: %w", ctx.Err())
		case <-t.C:
		}
	}
}

// kindFlowTargets is the hand-over record of what the portals did with each UDP target
// (portal.FlowTargets).
const kindFlowTargets = "flow-targets"

// flowTargetsRecord returns the record of the portals' UDP targets (none when portals is nil).
func flowTargetsRecord(portals *portal.Set) []handover.Record {
	if portals == nil {
		return nil
	}
	r, err := handover.NewRecord(kindFlowTargets, portals.FlowTargets())
	if err != nil { // maps of strings always encode
		return nil
	}
	return []handover.Record{r}
}

// adoptFlowTargets seeds the portals with the predecessor's UDP targets, so that their first
// sync keeps the conntrack flows of the UDP sessions just adopted.
func adoptFlowTargets(pkg *handover.Package, portals *portal.Set, log zerolog.Logger) {
	for _, r := range pkg.Records {
		if r.Kind != kindFlowTargets || portals == nil {
			continue
		}
		var ft portal.FlowTargets
		if err := json.Unmarshal(r.Meta, &ft); err != nil {
			log.Warn().Err(err).Msg("the predecessor's UDP targets are unreadable: the first sync deletes every UDP flow")
			return
		}
		portals.SeedFlowTargets(ft)
	}
}

// recordKinds counts records by kind, for logs and metrics.
func recordKinds(recs []handover.Record) map[string]int {
	out := map[string]int{}
	for _, r := range recs {
		out[r.Kind]++
	}
	return out
}

// giver hands the running proxy over to a successor (handover.Giver). handover.Listener.Serve
// calls its methods one exchange at a time.
type giver struct {
	px      *userspace.Proxier
	srv     *servers
	portals *portal.Set // nil without portals
	release func()      // the instance lock's

	frozenAt time.Time      // the current exchange's Freeze
	kinds    map[string]int // what it froze
}

func (g *giver) Freeze(ctx context.Context) (*handover.Package, error) {
	g.frozenAt = time.Now()
	recs, err := g.px.Freeze(ctx)
	if err != nil {
		g.srv.metrics.Handover(metrics.HandoverPredecessor, metrics.HandoverFailed, 0, nil)
		return nil, err
	}
	srvRecs, err := g.srv.handoverRecords()
	if err == nil {
		srvRecs = append(srvRecs, flowTargetsRecord(g.portals)...)
	}
	if err != nil {
		g.px.Resume(recs)
		g.srv.metrics.Handover(metrics.HandoverPredecessor, metrics.HandoverFailed, 0, nil)
		return nil, err
	}
	recs = append(recs, srvRecs...)
	g.kinds = recordKinds(recs)
	return &handover.Package{Records: recs}, nil
}

func (g *giver) Release() {
	g.px.Release()
	took := time.Since(g.frozenAt)
	g.srv.metrics.Handover(metrics.HandoverPredecessor, metrics.HandoverCompleted, took, g.kinds)
	g.release()
}

func (g *giver) Resume(pkg *handover.Package) {
	g.px.Resume(pkg.Records)
	pkg.Close() // the servers' duplicates: they still serve on their own sockets
	g.srv.metrics.Handover(metrics.HandoverPredecessor, metrics.HandoverFailed, time.Since(g.frozenAt), nil)
}

// serveHandovers answers successors on path until ctx ends; handedOver is closed when one took
// everything over.
func serveHandovers(ctx context.Context, path string, g *giver, handedOver chan<- struct{}, log zerolog.Logger) (stop func(), err error) {
	ln, err := handover.Listen(path, log)
	if err != nil {
		return nil, err
	}
	log.Info().Str("socket", path).Msg("a successor can take over through the hand-over socket")
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	handed := false // written before done is closed
	go func() {
		defer close(done)
		if ln.Serve(sctx, g, handoverTimeout) {
			handed = true
			close(handedOver)
		}
	}()
	return func() {
		cancel()
		<-done
		if handed {
			_ = ln.CloseHandedOver() // the path is the successor's socket now
			return
		}
		_ = ln.Close()
	}, nil
}
