package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/rs/zerolog"
	"github.com/spf13/pflag"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
)

// The holder: `kube-userspace-proxy hold` keeps duplicates of the proxy's listening sockets
// (handover.Store) so that they outlive the proxy's process. In the DaemonSet it is a second
// container of the proxy's pod (a child process would die with the proxy's container), and the
// two share the socket's directory, an emptyDir of the pod.

// HoldCommand is the subcommand that runs the holder.
const HoldCommand = "hold"

// PodUIDEnv names the environment variable holding the pod's UID (the DaemonSet sets it from
// the downward API): the proxy refuses a holder of another pod.
const PodUIDEnv = "POD_UID"

// holdExchangeTimeout bounds one exchange between the proxy and the holder.
const holdExchangeTimeout = 10 * time.Second

// holdMain runs the holder until SIGTERM or SIGINT; it returns the exit code.
func holdMain(args []string, stderr io.Writer) int {
	fs := pflag.NewFlagSet("kube-userspace-proxy hold", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	socket := fs.String("socket", "", "The Unix socket to keep the proxy's listening sockets on (the proxy's --holder-socket). Required. Its directory is made mode 0700, the socket 0600, and only processes of this user are answered.")
	level := fs.String("log-level", "info", "Log level: debug, info, warn or error.")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: kube-userspace-proxy hold --socket PATH\n\n"+
			"Keeps duplicates of the proxy's listening sockets so that they outlive the proxy: it never accepts or reads\n"+
			"on them; after a crash, the next proxy takes them back and serves what queued meanwhile.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, pflag.ErrHelp) {
			return 0
		}
		return 2
	}
	lvl, err := parseLevel(*level)
	if err != nil || *socket == "" || fs.NArg() > 0 {
		switch {
		case err != nil:
			fmt.Fprintf(stderr, "invalid options: --log-level: %v\n", err)
		case *socket == "":
			fmt.Fprintln(stderr, "invalid options: --socket: required")
		default:
			fmt.Fprintf(stderr, "invalid options: unexpected arguments %q\n", fs.Args())
		}
		return 2
	}
	zerolog.TimeFieldFormat = time.RFC3339Nano
	log := zerolog.New(zerolog.ConsoleWriter{Out: stderr, TimeFormat: logTimeFormat, NoColor: !isTerminal(stderr)}).
		Level(lvl).With().Timestamp().Str("component", "holder").Logger()
	ctx, stop := signalContext(context.Background(), log, os.Exit)
	defer stop()
	ln, err := handover.ListenStore(*socket)
	if err != nil {
		log.Error().Err(err).Msg("exiting")
		return 1
	}
	store := handover.NewStore(os.Getenv(PodUIDEnv), log)
	log.Info().Str("socket", *socket).Str("version", Version).Msg("keeping the proxy's listening sockets")
	store.Serve(ctx, ln, holdExchangeTimeout)
	n := store.Len()
	_ = ln.Close()
	store.Close()
	log.Info().Int("sockets", n).Msg("closed the sockets kept; exiting")
	return 0
}

// keptLister is what the keeper needs of the proxier.
type keptLister interface {
	KeptListeners() []handover.KeptListener
	AdoptKept(recs []handover.Record) int
}

// keeper keeps the holder's sockets those of the proxier's listeners: after each sync (kick)
// and every keeperCheck it sends what changed, or the whole set when the holder is not the
// one, or not at the generation, it last told.
type keeper struct {
	sc   *handover.StoreClient
	px   keptLister
	log  zerolog.Logger
	kick chan struct{}

	told  map[string]handover.KeptListener // what the holder keeps, as last told (nil: unknown)
	base  handover.StoreState
	quiet bool // the holder's absence was logged
}

// keeperCheck is how often the keeper checks that the holder is still the one it told, so that
// a restarted holder gets the sockets without waiting for a sync.
const keeperCheck = 5 * time.Second

func newKeeper(path string, px keptLister, log zerolog.Logger) *keeper {
	return &keeper{sc: &handover.StoreClient{Path: path, Pod: os.Getenv(PodUIDEnv)}, px: px, log: log, kick: make(chan struct{}, 1)}
}

// synced tells the keeper that a sync ended; it never blocks.
func (k *keeper) synced() {
	select {
	case k.kick <- struct{}{}:
	default:
	}
}

// adopt takes back what the holder kept for the proxy before this one (a start that is not a
// hand-over) and gives it to the proxier, which checks each socket. Without a holder, or with
// one that cannot be used, the proxy starts cold: adopt only logs.
func (k *keeper) adopt(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, holdExchangeTimeout)
	defer cancel()
	began := time.Now()
	info, recs, err := k.sc.Take(ctx)
	if err != nil {
		k.log.Warn().Err(err).Msg("no listening sockets from the holder: opening them anew")
		k.quiet = true
		return
	}
	taken := k.px.AdoptKept(recs)
	(&handover.Package{Records: recs}).Close()
	k.log.Info().Int("kept", len(recs)).Int("adopted", taken).Int("holderPid", info.PID).Dur("took", time.Since(began)).
		Msg("took the listening sockets the holder kept; each serves once the first sync wants its service port")
}

// run keeps the holder up to date until ctx ends, from the first sync on: until then the
// proxier has no listener (a holder told so would let go of the sockets a crash left it).
func (k *keeper) run(ctx context.Context) {
	select {
	case <-ctx.Done():
		return
	case <-k.kick:
	}
	k.reconcile(ctx)
	t := time.NewTicker(keeperCheck)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-k.kick:
		case <-t.C:
		}
		k.reconcile(ctx)
	}
}

// reconcile tells the holder what changed since it last did.
func (k *keeper) reconcile(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, holdExchangeTimeout)
	defer cancel()
	cur := k.px.KeptListeners()
	if cur == nil {
		return // frozen for a hand-over, or closed: the holder keeps what it has
	}
	now := make(map[string]handover.KeptListener, len(cur))
	for _, l := range cur {
		now[l.Key()] = l
	}
	var err error
	var info handover.StoreInfo
	if k.told == nil {
		info, err = k.sc.Replace(ctx, cur)
	} else {
		var put []handover.KeptListener
		var drop []string
		for key, l := range now {
			if was, ok := k.told[key]; !ok || was != l {
				put = append(put, l)
			}
		}
		for key := range k.told {
			if _, ok := now[key]; !ok {
				drop = append(drop, key)
			}
		}
		if len(put) == 0 && len(drop) == 0 {
			info, err = k.sc.Status(ctx)
			if err == nil && info.StoreState == k.base {
				return
			}
			if err == nil { // another holder, or another generation: tell it everything
				k.log.Info().Int("holderPid", info.PID).Msg("the holder is not the one told last: giving it every listening socket")
				info, err = k.sc.Replace(ctx, cur)
			}
		} else {
			info, err = k.sc.Update(ctx, k.base, put, drop)
			if errors.Is(err, handover.ErrStoreMoved) {
				info, err = k.sc.Replace(ctx, cur)
			}
		}
	}
	if err != nil {
		k.told = nil
		if !k.quiet {
			k.log.Warn().Err(err).Msg("the holder cannot be told the listening sockets: they do not outlive a crash until it can")
			k.quiet = true
		}
		return
	}
	if k.quiet {
		k.log.Info().Int("holderPid", info.PID).Int("sockets", info.Count).Msg("the holder keeps the listening sockets")
		k.quiet = false
	}
	k.told, k.base = now, info.StoreState
}

// clear empties the holder: the proxy handed everything over (its successor's holder keeps the
// sockets now) or shuts down (its rules are gone).
func (k *keeper) clear() {
	ctx, cancel := context.WithTimeout(context.Background(), holdExchangeTimeout)
	defer cancel()
	if _, err := k.sc.Replace(ctx, nil); err != nil {
		k.log.Debug().Err(err).Msg("could not empty the holder")
		return
	}
	k.log.Info().Msg("the holder keeps no socket of this proxy any more")
}
