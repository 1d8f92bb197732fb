//go:build linux

package handover

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// startStore serves a store at a temporary path until the test ends.
func startStore(t *testing.T, pod string) (*Store, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "holder", "holder.sock")
	ln, err := ListenStore(path)
	if err != nil {
		t.Fatal(err)
	}
	s := NewStore(pod, zerolog.New(zerolog.NewTestWriter(t)))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Serve(ctx, ln, 5*time.Second); close(done) }()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = ln.Close()
		s.Close()
	})
	return s, path
}

func tcpListener(t *testing.T) *net.TCPListener {
	t.Helper()
	ln, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	return ln
}

func kept(name string, ln *net.TCPListener) KeptListener {
	return KeptListener{
		Meta: ListenerMeta{Name: proxy.Name{Namespace: "ns", Name: name, Port: "p"}, Protocol: v1.ProtocolTCP, ProxyPort: ln.Addr().(*net.TCPAddr).Port},
		Conn: ln,
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// A listener whose own process closed it lives on in the store: a connection made meanwhile is
// queued, and accepted on the duplicate taken from the store.
func TestStoreKeepsListenerAcrossItsOwnersClose(t *testing.T) {
	s, path := startStore(t, "pod-a")
	sc := &StoreClient{Path: path, Pod: "pod-a"}
	a, b := tcpListener(t), tcpListener(t)
	info, err := sc.Replace(ctxT(t), []KeptListener{kept("a", a), kept("b", b)})
	if err != nil {
		t.Fatal(err)
	}
	if info.Count != 2 || info.Gen != 1 || s.Len() != 2 {
		t.Fatalf("after replace: %+v, store %d", info, s.Len())
	}
	addr := a.Addr().String()
	_ = a.Close() // the proxy dies
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatalf("a connection while only the holder keeps the listener: %v", err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("queued")); err != nil {
		t.Fatal(err)
	}

	info2, recs, err := sc.Take(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	defer (&Package{Records: recs}).Close()
	if info2.StoreState != info.StoreState || len(recs) != 2 {
		t.Fatalf("take: %+v, %d records; want %+v and 2", info2, len(recs), info.StoreState)
	}
	var got *net.TCPListener
	for i := range recs {
		var m ListenerMeta
		if err := recs[i].Decode(&m, 1, 1); err != nil {
			t.Fatal(err)
		}
		if m.Name.Name != "a" {
			continue
		}
		l, err := net.FileListener(recs[i].Files[0])
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		got = l.(*net.TCPListener)
	}
	if got == nil || got.Addr().String() != addr {
		t.Fatalf("taken listener %v, want one on %s", got, addr)
	}
	_ = got.SetDeadline(time.Now().Add(5 * time.Second))
	ac, err := got.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer ac.Close()
	buf := make([]byte, 6)
	if _, err := io.ReadFull(ac, buf); err != nil || string(buf) != "queued" {
		t.Fatalf("read %q, %v", buf, err)
	}
	if s.Len() != 2 {
		t.Errorf("the store lets go of what it hands out: %d left", s.Len())
	}
}

// An update applies against the generation it was made for; against another it is refused
// and nothing changes. Dropped and replaced sockets are closed in the holder.
func TestStoreUpdateAndGenerations(t *testing.T) {
	s, path := startStore(t, "")
	sc := &StoreClient{Path: path}
	a, b := tcpListener(t), tcpListener(t)
	info, err := sc.Replace(ctxT(t), []KeptListener{kept("a", a)})
	if err != nil {
		t.Fatal(err)
	}
	info, err = sc.Update(ctxT(t), info.StoreState, []KeptListener{kept("b", b)}, []string{kept("a", a).Key()})
	if err != nil {
		t.Fatal(err)
	}
	if keys := s.Keys(); len(keys) != 1 || keys[0] != kept("b", b).Key() || info.Gen != 2 {
		t.Fatalf("after update: %v, gen %d", keys, info.Gen)
	}
	stale := StoreState{Instance: info.Instance, Gen: 1}
	if _, err := sc.Update(ctxT(t), stale, []KeptListener{kept("a", a)}, nil); !errors.Is(err, ErrStoreMoved) {
		t.Fatalf("update against a stale generation: %v, want ErrStoreMoved", err)
	}
	if keys := s.Keys(); len(keys) != 1 {
		t.Fatalf("a refused update changed the store: %v", keys)
	}
	// Dropped from the store and closed by its owner: nothing listens any more.
	addrA := a.Addr().String()
	_ = a.Close()
	if c, err := net.DialTimeout("tcp", addrA, time.Second); err == nil {
		c.Close()
		t.Fatal("a dropped listener still accepts connections: the holder kept it")
	}
	if _, err := sc.Replace(ctxT(t), nil); err != nil {
		t.Fatal(err)
	}
	if s.Len() != 0 {
		t.Fatalf("an empty replace left %d sockets", s.Len())
	}
}

// What is not a listening socket is not kept; a holder of another pod, and a second holder
// on the same socket, are refused.
func TestStoreRefusesWhatItShouldNot(t *testing.T) {
	s, path := startStore(t, "pod-a")
	// A pipe is no socket.
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	pipe := KeptListener{Meta: ListenerMeta{Name: proxy.Name{Name: "pipe"}, Protocol: v1.ProtocolTCP, ProxyPort: 1}, Conn: w}
	bad := KeptListener{Meta: ListenerMeta{Name: proxy.Name{Name: "bad"}, Protocol: "SCTP", ProxyPort: 1}, Conn: tcpListener(t)}
	good := kept("good", tcpListener(t))
	info, err := (&StoreClient{Path: path}).Replace(ctxT(t), []KeptListener{pipe, bad, good})
	if err != nil {
		t.Fatal(err)
	}
	if keys := s.Keys(); info.Count != 1 || len(keys) != 1 || keys[0] != good.Key() {
		t.Fatalf("kept %v (count %d), want only %s", keys, info.Count, good.Key())
	}
	if _, err := (&StoreClient{Path: path, Pod: "pod-b"}).Status(ctxT(t)); err == nil {
		t.Fatal("a proxy of pod-b accepted pod-a's holder")
	}
	if ln, err := ListenStore(path); err == nil {
		ln.Close()
		t.Fatal("a second holder opened the same socket")
	}
	st, err := os.Stat(filepath.Dir(path))
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o700 {
		t.Errorf("socket directory mode %v, want 0700", st.Mode().Perm())
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("socket mode %v (%v), want 0600", st.Mode().Perm(), err)
	}
	if _, err := (&StoreClient{Path: filepath.Join(t.TempDir(), "none.sock")}).Status(ctxT(t)); err == nil {
		t.Fatal("no holder: Status succeeded")
	}
}

// More listeners than one message carries go to the holder and come back in several messages;
// the duplicates the proxy makes to send them are closed once sent.
func TestStoreManyListeners(t *testing.T) {
	s, path := startStore(t, "")
	sc := &StoreClient{Path: path}
	const n = 2*maxFilesPerMessage + 100
	ls := make([]KeptListener, n)
	for i := range ls {
		ls[i] = kept(fmt.Sprintf("l%d", i), tcpListener(t))
	}
	before := openFDs(t)
	info, err := sc.Replace(ctxT(t), ls)
	if err != nil {
		t.Fatal(err)
	}
	if info.Count != n || s.Len() != n {
		t.Fatalf("after replace: %+v, store %d; want %d", info, s.Len(), n)
	}
	// The store runs in this process: it holds n more, the proxy's side none (once the store
	// has closed its end of the exchange, which it does after its answer).
	got := openFDs(t) - before
	for deadline := time.Now().Add(5 * time.Second); got != n && time.Now().Before(deadline); got = openFDs(t) - before {
		time.Sleep(10 * time.Millisecond)
	}
	if got != n {
		t.Errorf("%d more descriptors open after the replace, want the store's %d", got, n)
	}
	_, recs, err := sc.Take(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	defer (&Package{Records: recs}).Close()
	if len(recs) != n {
		t.Fatalf("took %d records, want %d", len(recs), n)
	}
	seen := map[string]bool{}
	for i := range recs {
		var m ListenerMeta
		if err := recs[i].Decode(&m, 1, 1); err != nil {
			t.Fatal(err)
		}
		seen[m.Name.Name] = true
	}
	if len(seen) != n {
		t.Errorf("%d distinct listeners taken, want %d", len(seen), n)
	}
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}
