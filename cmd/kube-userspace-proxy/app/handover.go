package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
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

// handoverSocket returns the hand-over socket's path: --handover-socket, or the default
// (defaultHandoverSocket: on Linux this network namespace's socket in InstanceLockDir, elsewhere
// none); "" when hand-overs are off.
func handoverSocket(opts *Options) (string, error) {
	switch opts.HandoverSocket {
	case HandoverNone:
		return "", nil
	case "":
		return defaultHandoverSocket()
	}
	return opts.HandoverSocket, nil
}

// takeOver is a successor's start: once its source has delivered the initial state (so that it
// can serve at once), it asks the running proxy for everything and adopts it. When the running
// proxy refuses or the hand-over fails, it falls back to a restart: it waits for the running
// proxy to exit (its instance lock to be free). It returns the package (what the proxier did not
// adopt is the caller's: the servers' sockets) and the instance lock. The running proxy passes
// its lock on with its release (protocol version 2), so that no third proxy can take it in
// between and start afresh beside this one; an older one frees it, and this one takes it.
func takeOver(ctx context.Context, path string, px *userspace.Proxier, portals *portal.Set, m *metrics.Metrics, log zerolog.Logger) (*handover.Package, *instanceLock, error) {
	select {
	case <-px.Synced():
	case <-ctx.Done():
		return nil, nil, ctx.Err()
	}
	var lock *instanceLock
	claim := func(passed *os.File) error {
		var err error
		if passed != nil {
			lock, err = adoptInstanceLock(passed)
		} else {
			lock, err = lockInstance(InstanceLockDir)
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
		return pkg, lock, nil
	}
	lock.release() // claimed, yet Take failed: cannot happen, but never hold the lock twice
	what, result := "hand-over failed", metrics.HandoverFailed
	if errors.Is(err, handover.ErrRefused) {
		what, result = "hand-over refused", metrics.HandoverRefused
	}
	m.Handover(metrics.HandoverSuccessor, result, took, nil)
	log.Warn().Err(err).Msg(what + "; falling back to a restart: waiting for the running proxy to exit")
	lock, err = waitForLock(ctx, log)
	return nil, lock, err
}

// waitForLock takes the instance lock once the running proxy frees it, or fails when ctx ends.
func waitForLock(ctx context.Context, log zerolog.Logger) (*instanceLock, error) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	logged := time.Now()
	for {
		lock, err := lockInstance(InstanceLockDir)
		if err == nil {
			log.Info().Msg("the running proxy exited; starting")
			return lock, nil
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

// flowTargetsRecord returns the record of the portals' UDP targets (none when portals is nil).
func flowTargetsRecord(portals *portal.Set) []handover.Record {
	if portals == nil {
		return nil
	}
	r, err := handover.NewRecord(handover.KindFlowTargets, portals.FlowTargets())
	if err != nil { // maps of strings always encode
		return nil
	}
	return []handover.Record{r}
}

// adoptFlowTargets seeds the portals with the predecessor's UDP targets, so that their first
// sync keeps the conntrack flows of the UDP sessions just adopted.
func adoptFlowTargets(pkg *handover.Package, portals *portal.Set, log zerolog.Logger) {
	for _, r := range pkg.Records {
		if r.Kind != handover.KindFlowTargets || portals == nil {
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

// giver hands the running proxy over to a successor (handover.LockGiver: its instance lock
// goes along). handover.Listener.Serve calls its methods one exchange at a time.
type giver struct {
	px      *userspace.Proxier
	srv     *servers
	portals *portal.Set // nil without portals
	lock    *instanceLock
	ready   *readyFile // removed while frozen: the successor is about to serve

	frozenAt time.Time      // the current exchange's Freeze
	kinds    map[string]int // what it froze
}

func (g *giver) Freeze(ctx context.Context) (*handover.Package, error) {
	g.frozenAt = time.Now()
	g.ready.freeze()
	recs, err := g.px.Freeze(ctx)
	if err != nil {
		g.ready.thaw()
		g.srv.metrics.Handover(metrics.HandoverPredecessor, metrics.HandoverFailed, 0, nil)
		return nil, err
	}
	srvRecs, err := g.srv.handoverRecords()
	if err == nil {
		srvRecs = append(srvRecs, flowTargetsRecord(g.portals)...)
	}
	if err != nil {
		g.px.Resume(recs)
		g.ready.thaw()
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
	g.lock.release() // a duplicate from LockFile, on its way to the successor, may hold it on
}

// LockFile returns a duplicate of the instance lock's descriptor, for the successor.
func (g *giver) LockFile() (*os.File, error) { return g.lock.dup() }

var _ handover.LockGiver = (*giver)(nil)

func (g *giver) Resume(pkg *handover.Package) {
	g.px.Resume(pkg.Records)
	g.ready.thaw()
	pkg.Close() // the servers' duplicates: they still serve on their own sockets
	g.srv.metrics.Handover(metrics.HandoverPredecessor, metrics.HandoverFailed, time.Since(g.frozenAt), nil)
}

// serveHandovers answers successors on path until ctx ends; handedOver is closed when one took
// everything over. stop ends the answering: it waits for an exchange under way (bounded by
// handoverTimeout) to end, and reports whether a successor took over. Call it before deciding
// between a hand-over's end and a shutdown's: a SIGTERM that comes during an exchange must
// not remove the portals a successor is taking over.
func serveHandovers(ctx context.Context, path string, g handover.Giver, handedOver chan<- struct{}, log zerolog.Logger) (stop func() bool, err error) {
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
	var once sync.Once
	return func() bool {
		once.Do(func() {
			cancel()
			<-done
			if handed {
				_ = ln.CloseHandedOver() // the path is the successor's socket now
				return
			}
			_ = ln.Close()
		})
		return handed
	}, nil
}
