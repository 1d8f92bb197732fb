//go:build linux

package app

import (
	"bytes"
	"context"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover/handovertest"
)

// fakeLister stands for the proxier: its listeners are real sockets.
type fakeLister struct{ ls []handover.KeptListener }

func (f *fakeLister) KeptListeners() []handover.KeptListener { return f.ls }
func (f *fakeLister) AdoptKept(recs []handover.Record) int   { return len(recs) }

func listenerNamed(t *testing.T, name string) handover.KeptListener {
	t.Helper()
	ln, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	return handover.KeptListener{
		Meta: handover.ListenerMeta{Name: proxy.Name{Namespace: "ns", Name: name}, Protocol: v1.ProtocolTCP, ProxyPort: ln.Addr().(*net.TCPAddr).Port},
		Conn: ln,
	}
}

// The keeper tells the holder the proxier's listeners: all of them first, then what changed;
// a restarted holder gets all of them again at the next check; without a holder it says so
// once, and empties the holder when the proxy hands over or stops.
func TestKeeperFollowsTheListeners(t *testing.T) {
	path := filepath.Join(t.TempDir(), "holder", "holder.sock")
	var logs bytes.Buffer
	px := &fakeLister{}
	k := newKeeper(path, px, zerolog.New(&logs))
	ctx := context.Background()

	// No holder yet: one warning, however often it tries.
	px.ls = []handover.KeptListener{listenerNamed(t, "a")}
	k.reconcile(ctx)
	k.reconcile(ctx)
	if n := strings.Count(logs.String(), "cannot be told"); n != 1 {
		t.Errorf("%d warnings without a holder, want 1:\n%s", n, logs.String())
	}

	store, stop := handovertest.ServeStore(t, path)
	keys := func(ls ...handover.KeptListener) []string {
		var out []string
		for _, l := range ls {
			out = append(out, l.Key())
		}
		slices.Sort(out)
		return out
	}
	k.reconcile(ctx)
	if got := store.Keys(); !slices.Equal(got, keys(px.ls...)) {
		t.Fatalf("the holder keeps %v, want %v", got, keys(px.ls...))
	}
	b, c := listenerNamed(t, "b"), listenerNamed(t, "c")
	px.ls = []handover.KeptListener{b, c} // a went, b and c came
	k.reconcile(ctx)
	if got := store.Keys(); !slices.Equal(got, keys(b, c)) {
		t.Fatalf("after a change the holder keeps %v, want %v", got, keys(b, c))
	}
	if k.base.Gen != 2 {
		t.Errorf("generation %d after a replace and an update, want 2", k.base.Gen)
	}
	k.reconcile(ctx) // nothing changed: nothing sent
	if k.base.Gen != 2 {
		t.Errorf("generation %d after a reconcile without a change, want 2", k.base.Gen)
	}

	// The holder restarts: empty, another instance. The next check gives it everything.
	stop()
	store, _ = handovertest.ServeStore(t, path)
	k.reconcile(ctx)
	if got := store.Keys(); !slices.Equal(got, keys(b, c)) {
		t.Fatalf("a restarted holder keeps %v, want %v", got, keys(b, c))
	}

	// Frozen (nil): the holder keeps what it has.
	px.ls = nil
	k.reconcile(ctx)
	if store.Len() != 2 {
		t.Errorf("a frozen proxier's reconcile changed the holder: %d sockets", store.Len())
	}
	k.clear()
	if store.Len() != 0 {
		t.Errorf("clear left %d sockets in the holder", store.Len())
	}
}

// The holder command refuses bad arguments, and a second holder on a socket in use.
func TestHoldMainArguments(t *testing.T) {
	var stderr bytes.Buffer
	if code := Main([]string{HoldCommand}, &bytes.Buffer{}, &stderr); code != 2 || !strings.Contains(stderr.String(), "--socket: required") {
		t.Errorf("hold without --socket: exit %d, %q", code, stderr.String())
	}
	path := filepath.Join(t.TempDir(), "h", "holder.sock")
	handovertest.ServeStore(t, path)
	stderr.Reset()
	if code := Main([]string{HoldCommand, "--socket=" + path}, &bytes.Buffer{}, &stderr); code != 1 || !strings.Contains(stderr.String(), "another holder") {
		t.Errorf("a second holder on %s: exit %d, %q", path, code, stderr.String())
	}
}
