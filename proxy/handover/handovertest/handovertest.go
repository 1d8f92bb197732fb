// Package handovertest runs a holder's listener store (package handover) for the tests of the
// packages that talk to one: the proxier's kept listeners and the proxy's keeper.
package handovertest

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
)

// ServeStore serves a listener store on a Unix socket at path (its directory is made) until stop
// is called or the test ends, as the hold command does: the listener is closed, then the store
// and the sockets it keeps. Its log goes to the test's. stop may be called more than once; a
// test calls it to take the holder away before its end.
func ServeStore(t testing.TB, path string) (store *handover.Store, stop func()) {
	t.Helper()
	ln, err := handover.ListenStore(path)
	if err != nil {
		t.Fatal(err)
	}
	store = handover.NewStore("", zerolog.New(zerolog.NewTestWriter(t)))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { store.Serve(ctx, ln, 5*time.Second); close(done) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			<-done
			_ = ln.Close()
			store.Close()
		})
	}
	t.Cleanup(stop)
	return store, stop
}
