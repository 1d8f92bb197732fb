package app

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"

	"github.com/rs/zerolog"
)

// ExitSecondSignal is the exit code when a second SIGTERM/SIGINT ends the graceful shutdown.
const ExitSecondSignal = 1

// signalContext returns a context cancelled by the first SIGTERM or SIGINT (the graceful
// shutdown begins); a second one calls exit(ExitSecondSignal) at once, without waiting for the
// grace period or removing portals. stop releases the signals and waits for the watcher.
func signalContext(parent context.Context, log zerolog.Logger, exit func(code int)) (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancel(parent)
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		select {
		case s := <-sigs:
			log.Info().Str("signal", s.String()).Msg("shutting down gracefully; a second signal exits at once")
			cancel()
		case <-done:
			return
		}
		select {
		case s := <-sigs:
			log.Warn().Str("signal", s.String()).Msg("second signal: exiting at once")
			exit(ExitSecondSignal)
		case <-done:
		}
	})
	var once sync.Once
	return ctx, func() {
		once.Do(func() {
			signal.Stop(sigs)
			close(done)
			wg.Wait()
			cancel()
		})
	}
}

// setOOMScoreAdj writes v to path (normally oomScoreAdjPath).
func setOOMScoreAdj(path string, v int32) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("set oom_score_adj to %d: %w", v, err)
	}
	_, werr := f.WriteString(strconv.Itoa(int(v)))
	if err := errors.Join(werr, f.Close()); err != nil {
		return fmt.Errorf("set oom_score_adj to %d: %w", v, err)
	}
	return nil
}
