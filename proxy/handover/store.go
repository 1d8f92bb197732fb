package handover

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// The listener store: a holder process (the DaemonSet pod's second container) keeps
// duplicates of the running proxy's listening sockets, so that they outlive the proxy. When the
// proxy crashes, its portal rules stay and the sockets stay open in the holder: the kernel
// completes the handshakes of new connections and queues them (UDP datagrams in the socket's
// receive queue) until the next proxy takes the sockets from the holder and accepts them, as
// systemd's file-descriptor store does for socket-activated services. The holder never accepts
// or reads: it only keeps descriptors, so it cannot serve stale rules.
//
// One exchange per connection, the proxy (client) first:
//
//	proxy                                         holder
//	hello {versions, op, base, drop, pod}   →
//	                                         ←    welcome {instance, gen, count, netns, pod} | refuse {reason}
//	op take:                                 ←    records … (listener records), end {total}
//	op replace, update:  records …, end     →
//	                                         ←    stored {gen, count}
//
// replace sets the holder's sockets to the ones sent; update drops the keys named in drop and
// puts the ones sent, and is refused unless the holder is still at base (its instance and
// generation), so the proxy's idea of what the holder keeps is never wrong for long: on a
// refusal it replaces. Either is applied at once or not at all.

// StoreVersion is the listener store's protocol version.
const StoreVersion = 1

const (
	storeOpTake    = "take"
	storeOpReplace = "replace"
	storeOpUpdate  = "update"
	storeOpStatus  = "status"
	msgStored      = "stored"
)

// ErrStoreMoved is returned by StoreClient.Update when the holder is not at the base the
// update was made against (it restarted, or another proxy changed it): replace instead.
var ErrStoreMoved = errors.New("listener store: the holder's sockets are not the ones the update was made against")

// StoreState names a holder's set of sockets: the holder process (a random instance name made
// at its start) and the generation of its set, one more at each change.
type StoreState struct {
	Instance string `json:"instance,omitempty"`
	Gen      uint64 `json:"gen,omitempty"`
}

// StoreInfo is what a holder says of itself.
type StoreInfo struct {
	StoreState
	PID   int    `json:"pid,omitempty"`
	Pod   string `json:"pod,omitempty"`
	Count int    `json:"count"`
	NetNS uint64 `json:"netns,omitempty"`
}

// storeMessage is a listener store message other than records and end (message's).
type storeMessage struct {
	Type     string      `json:"type"`
	Versions []int       `json:"versions,omitempty"`
	Version  int         `json:"version,omitempty"`
	Op       string      `json:"op,omitempty"`
	Base     *StoreState `json:"base,omitempty"`
	Drop     []string    `json:"drop,omitempty"`
	Pod      string      `json:"pod,omitempty"`
	PID      int         `json:"pid,omitempty"`
	Reason   string      `json:"reason,omitempty"`
	Info     *StoreInfo  `json:"info,omitempty"`
}

// StoreKey names a service port's listener in the store.
func StoreKey(name proxy.Name, protocol v1.Protocol) string {
	return name.String() + "/" + string(protocol)
}

// KeptListener is one listening socket for the holder to keep: its record's meta and the
// socket, read through SyscallConn (never Fd, which would make a shared socket blocking).
type KeptListener struct {
	Meta ListenerMeta
	Conn syscall.Conn
}

// Key is the listener's key in the store.
func (k KeptListener) Key() string { return StoreKey(k.Meta.Name, k.Meta.Protocol) }

// keptSocket is a socket the holder keeps: its record's meta and its descriptor, a plain one
// that Go's network poller never watches (the holder must not wake at every connection that
// queues on it).
type keptSocket struct {
	meta json.RawMessage
	fd   int
}

// Store is the holder's set of listening sockets. It serves proxies on a StoreListener.
type Store struct {
	log      zerolog.Logger
	pod      string
	instance string

	mu    sync.Mutex
	gen   uint64
	socks map[string]keptSocket
}

// NewStore returns an empty store; pod names the pod it belongs to ("" when unknown), which a
// proxy of another pod refuses.
func NewStore(pod string, log zerolog.Logger) *Store {
	return &Store{log: log, pod: pod, instance: randomInstance(), socks: map[string]keptSocket{}}
}

// Len returns how many sockets the store keeps.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.socks)
}

// Keys returns the keys of the sockets the store keeps, sorted.
func (s *Store) Keys() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	keys := make([]string, 0, len(s.socks))
	for k := range s.socks {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// Close closes every socket the store keeps.
func (s *Store) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, ks := range s.socks {
		closeFD(ks.fd)
		delete(s.socks, k)
	}
}

func (s *Store) info() StoreInfo {
	return StoreInfo{StoreState: StoreState{Instance: s.instance, Gen: s.gen}, PID: os.Getpid(), Pod: s.pod, Count: len(s.socks), NetNS: selfNetNS()}
}

// StoreListener is the holder's Unix socket.
type StoreListener struct {
	ln   *net.UnixListener
	lock *os.File
	path string
}

// ListenStore opens the holder's socket at path. Its directory is made (or made) mode 0700 and
// the socket mode 0600, and each peer must run as this process's user (SO_PEERCRED): only root
// on the node reaches a holder run as root. A lock file beside it (path + ".lock") keeps a
// second holder off the path; a stale socket left by a dead holder is replaced.
func ListenStore(path string) (*StoreListener, error) {
	if err := supported(); err != nil {
		return nil, err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("listener store socket: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("listener store socket: %w", err)
	}
	lock, err := lockFile(path + ".lock")
	if err != nil {
		return nil, fmt.Errorf("listener store socket %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		lock.Close()
		return nil, fmt.Errorf("listener store socket: removing the stale one: %w", err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		lock.Close()
		return nil, fmt.Errorf("listener store socket: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		lock.Close()
		return nil, fmt.Errorf("listener store socket: %w", err)
	}
	return &StoreListener{ln: ln, lock: lock, path: path}, nil
}

// Close closes the socket (removing its file) and frees the lock.
func (l *StoreListener) Close() error {
	err := l.ln.Close()
	_ = l.lock.Close()
	return err
}

// Serve answers proxies on l, one exchange at a time, until ctx ends; each exchange is bounded
// by timeout.
func (s *Store) Serve(ctx context.Context, l *StoreListener, timeout time.Duration) {
	stop := context.AfterFunc(ctx, func() { _ = l.ln.SetDeadline(time.Now()) })
	defer stop()
	for {
		uc, err := l.ln.AcceptUnix()
		if err != nil {
			if ctx.Err() == nil {
				s.log.Error().Err(err).Msg("listener store: accept failed; no proxy can reach the holder")
			}
			return
		}
		c := &conn{uc: uc}
		_ = uc.SetDeadline(time.Now().Add(timeout))
		if err := s.serveOne(c); err != nil {
			s.log.Warn().Err(err).Msg("listener store: exchange failed; the sockets kept are unchanged")
		}
		_ = uc.Close()
	}
}

// serveOne runs one exchange.
func (s *Store) serveOne(c *conn) error {
	uid, pid, err := peerCred(c.uc)
	if err != nil {
		return err
	}
	if want := os.Geteuid(); uid != want {
		return fmt.Errorf("a process of uid %d (pid %d) connected; only uid %d may", uid, pid, want)
	}
	var hello storeMessage
	if files, err := c.recv(&hello); err != nil || hello.Type != msgHello {
		closeFiles(files)
		return fmt.Errorf("pid %d connected but did not say hello (%q): %v", pid, hello.Type, err)
	} else if len(files) > 0 {
		closeFiles(files)
		return fmt.Errorf("pid %d sent descriptors with its hello", pid)
	}
	log := s.log.With().Int("proxyPid", pid).Str("op", hello.Op).Logger()
	refuse := func(reason string) error {
		_ = c.send(storeMessage{Type: msgRefuse, Reason: reason}, nil)
		return errors.New(reason)
	}
	if !slices.Contains(hello.Versions, StoreVersion) {
		return refuse(fmt.Sprintf("no common protocol version: ours %d, the proxy's %v", StoreVersion, hello.Versions))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch hello.Op {
	case storeOpTake, storeOpStatus, storeOpReplace:
	case storeOpUpdate:
		if hello.Base == nil || *hello.Base != (StoreState{Instance: s.instance, Gen: s.gen}) {
			return refuse(ErrStoreMoved.Error())
		}
	default:
		return refuse(fmt.Sprintf("unknown operation %q", hello.Op))
	}
	info := s.info()
	if err := c.send(storeMessage{Type: msgWelcome, Version: StoreVersion, Info: &info}, nil); err != nil {
		return err
	}
	switch hello.Op {
	case storeOpTake:
		return s.sendAll(c)
	case storeOpReplace, storeOpUpdate:
		pkg, err := recvPackage(c)
		if err != nil {
			pkg.Close()
			return err
		}
		put := s.keepable(pkg, log)
		next := map[string]keptSocket{}
		if hello.Op == storeOpUpdate {
			for k, ks := range s.socks {
				next[k] = ks
			}
			for _, k := range hello.Drop {
				delete(next, k)
			}
		}
		for k, ks := range put {
			next[k] = ks
		}
		// Now the new set is whole: close what it no longer holds, and take it.
		for k, ks := range s.socks {
			if n, ok := next[k]; !ok || n.fd != ks.fd {
				closeFD(ks.fd)
			}
		}
		s.socks = next
		s.gen++
		info := s.info()
		log.Info().Int("sockets", len(next)).Int("put", len(put)).Int("dropped", len(hello.Drop)).Uint64("gen", s.gen).
			Msg("listener store: keeping the proxy's listening sockets")
		return c.send(storeMessage{Type: msgStored, Info: &info}, nil)
	}
	return nil
}

// keepable turns the received records into kept sockets; a record that is not a listener with
// one socket is logged and closed.
func (s *Store) keepable(pkg *Package, log zerolog.Logger) map[string]keptSocket {
	out := map[string]keptSocket{}
	for _, r := range pkg.Records {
		var m ListenerMeta
		err := r.Decode(&m, 1, 1)
		if err == nil && r.Kind != KindListener {
			err = fmt.Errorf("a %s record, want %s", r.Kind, KindListener)
		}
		if err == nil && (m.Protocol != v1.ProtocolTCP && m.Protocol != v1.ProtocolUDP || m.ProxyPort <= 0 || m.ProxyPort > 65535) {
			err = fmt.Errorf("listener of %s: protocol %q, port %d", m.Name, m.Protocol, m.ProxyPort)
		}
		var fd int
		if err == nil {
			fd, err = detachSocket(r.Files[0])
			r.Files = nil
		}
		if err != nil {
			closeFiles(r.Files)
			log.Warn().Err(err).Msg("listener store: record not kept")
			continue
		}
		k := StoreKey(m.Name, m.Protocol)
		if old, ok := out[k]; ok {
			closeFD(old.fd)
		}
		out[k] = keptSocket{meta: r.Meta, fd: fd}
	}
	return out
}

// sendAll sends a listener record for every kept socket (the kernel duplicates them into the
// proxy; the store keeps its own), then the end.
func (s *Store) sendAll(c *conn) error {
	keys := make([]string, 0, len(s.socks))
	for k := range s.socks {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	rs := recordSender{c: c}
	for _, k := range keys {
		ks := s.socks[k]
		if err := rs.add(Record{Kind: KindListener, Meta: ks.meta}, []int{ks.fd}); err != nil {
			return err
		}
	}
	return rs.end()
}

// StoreClient is a proxy's side of the listener store.
type StoreClient struct {
	// Path is the holder's socket.
	Path string
	// Pod names the proxy's pod: a holder of another pod is refused ("" checks nothing).
	Pod string
}

// exchange connects, says hello and checks the holder's welcome: it runs as this process's
// user, in this network namespace, of this pod.
func (sc *StoreClient) exchange(ctx context.Context, hello storeMessage) (*conn, StoreInfo, error) {
	if err := supported(); err != nil {
		return nil, StoreInfo{}, err
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", sc.Path)
	if err != nil {
		return nil, StoreInfo{}, fmt.Errorf("listener store: connecting to the holder: %w", err)
	}
	c := &conn{uc: nc.(*net.UnixConn)}
	fail := func(err error) (*conn, StoreInfo, error) {
		_ = c.uc.Close()
		return nil, StoreInfo{}, fmt.Errorf("listener store %s: %w", sc.Path, err)
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = c.uc.SetDeadline(dl)
	}
	uid, pid, err := peerCred(c.uc)
	if err != nil {
		return fail(err)
	}
	if want := os.Geteuid(); uid != want {
		return fail(fmt.Errorf("the holder (pid %d) runs as uid %d, not %d", pid, uid, want))
	}
	hello.Type, hello.Versions, hello.PID, hello.Pod = msgHello, []int{StoreVersion}, os.Getpid(), sc.Pod
	if err := c.send(hello, nil); err != nil {
		return fail(err)
	}
	var w storeMessage
	files, err := c.recv(&w)
	closeFiles(files)
	if err != nil {
		return fail(err)
	}
	switch {
	case w.Type == msgRefuse && w.Reason == ErrStoreMoved.Error():
		_ = c.uc.Close()
		return nil, StoreInfo{}, ErrStoreMoved
	case w.Type == msgRefuse:
		return fail(fmt.Errorf("%w: %s", ErrRefused, w.Reason))
	case w.Type != msgWelcome || w.Info == nil:
		return fail(fmt.Errorf("the holder answered %q", w.Type))
	}
	info := *w.Info
	if ns := selfNetNS(); info.NetNS != ns {
		return fail(fmt.Errorf("the holder (pid %d) is in network namespace %d, this proxy in %d", info.PID, info.NetNS, ns))
	}
	if sc.Pod != "" && info.Pod != "" && info.Pod != sc.Pod {
		return fail(fmt.Errorf("the holder (pid %d) is pod %s's, this proxy is pod %s's", info.PID, info.Pod, sc.Pod))
	}
	return c, info, nil
}

// Take returns duplicates of every socket the holder keeps, as listener records (the caller
// owns their files), and what the holder said of itself. The holder keeps its own.
func (sc *StoreClient) Take(ctx context.Context) (StoreInfo, []Record, error) {
	c, info, err := sc.exchange(ctx, storeMessage{Op: storeOpTake})
	if err != nil {
		return StoreInfo{}, nil, err
	}
	defer c.uc.Close()
	pkg, err := recvPackage(c)
	if err != nil {
		pkg.Close()
		return StoreInfo{}, nil, fmt.Errorf("listener store %s: %w", sc.Path, err)
	}
	return info, pkg.Records, nil
}

// Status returns what the holder says of itself.
func (sc *StoreClient) Status(ctx context.Context) (StoreInfo, error) {
	c, info, err := sc.exchange(ctx, storeMessage{Op: storeOpStatus})
	if err != nil {
		return StoreInfo{}, err
	}
	_ = c.uc.Close()
	return info, nil
}

// Replace sets the holder's sockets to ls (none: it closes all of them).
func (sc *StoreClient) Replace(ctx context.Context, ls []KeptListener) (StoreInfo, error) {
	return sc.store(ctx, storeMessage{Op: storeOpReplace}, ls)
}

// Update drops the keys in drop from the holder's sockets and puts ls (replacing sockets of
// the same key), provided the holder is still at base; otherwise it returns ErrStoreMoved.
func (sc *StoreClient) Update(ctx context.Context, base StoreState, ls []KeptListener, drop []string) (StoreInfo, error) {
	return sc.store(ctx, storeMessage{Op: storeOpUpdate, Base: &base, Drop: drop}, ls)
}

func (sc *StoreClient) store(ctx context.Context, hello storeMessage, ls []KeptListener) (StoreInfo, error) {
	c, _, err := sc.exchange(ctx, hello)
	if err != nil {
		return StoreInfo{}, err
	}
	defer c.uc.Close()
	if err := sendKept(c, ls); err != nil {
		return StoreInfo{}, fmt.Errorf("listener store %s: %w", sc.Path, err)
	}
	var m storeMessage
	files, err := c.recv(&m)
	closeFiles(files)
	if err != nil {
		return StoreInfo{}, fmt.Errorf("listener store %s: %w", sc.Path, err)
	}
	if m.Type != msgStored || m.Info == nil {
		return StoreInfo{}, fmt.Errorf("listener store %s: the holder answered %q (%s)", sc.Path, m.Type, m.Reason)
	}
	return *m.Info, nil
}

// sendKept sends ls as listener records, each with a duplicate of its socket made for the
// message and closed once sent; a socket closed meanwhile (its service port went away) is
// left out.
func sendKept(c *conn, ls []KeptListener) error {
	closeAll := func(fds []int) {
		for _, fd := range fds {
			closeFD(fd)
		}
	}
	rs := recordSender{c: c, sent: closeAll}
	defer func() { closeAll(rs.fds) }() // queued when an error ended the exchange
	for _, l := range ls {
		fd, err := dupConn(l.Conn)
		if err != nil {
			continue // closed since: its service port is gone
		}
		meta, err := json.Marshal(l.Meta)
		if err == nil {
			err = rs.add(Record{Kind: KindListener, Meta: meta}, []int{fd})
		}
		if err != nil {
			closeFD(fd)
			return fmt.Errorf("listener of %s: %w", l.Meta.Name, err)
		}
	}
	return rs.end()
}

// randomInstance names a holder process: its pid and start, enough to tell a restarted holder
// from the one before.
func randomInstance() string {
	return fmt.Sprintf("%d-%d", os.Getpid(), time.Now().UnixNano())
}
