// Package handover moves a running proxy's sockets and state to its successor: the listening
// sockets, the established connections with their bytes in flight, the UDP sessions and the
// affinity table travel over a Unix socket as JSON records with their descriptors attached
// (SCM_RIGHTS), so that a restart or an upgrade drops nothing and binds nothing anew.
//
// The exchange, one successor at a time:
//
//	successor                         predecessor
//	hello {versions}            →
//	                            ←     welcome {version}  |  refuse {reason}
//	                                  Freeze: stop serving, duplicate every descriptor
//	                            ←     records … (≤ 250 descriptors each), end {total}
//	ready                       →
//	                                  Release: close its own copies
//	                            ←     released {the instance lock's descriptor, version 2}
//
// Until it has sent ready, a failure on either side leaves the predecessor serving: it
// resumes with what it froze. After ready, the instance lock decides: the successor goes on
// with the records only once it holds the lock; otherwise the predecessor has resumed, and the
// successor drops the records and falls back to a restart. In version 2 the lock itself
// travels with released (a flock belongs to the open file, which the descriptor carries), so
// it is never free between the two: a third proxy started meanwhile cannot take it and start
// afresh beside them. In version 1 the predecessor frees the lock and the successor takes it
// (and a third one could take it in between). When the predecessor dies after ready, before
// released, its lock is free and the successor takes it: the descriptors are safe in its hands.
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
	"time"

	"github.com/rs/zerolog"
)

// Version is the newest protocol version this build speaks. A change to the records a kind
// carries, or to the exchange, is a new version; a build may speak several. Version 2: the
// instance lock travels with released (LockGiver).
const Version = 2

// versions are the versions this build accepts, preferred first.
var versions = []int{Version, 1}

// Record is one thing handed over: its kind ("tcp-listener", "udp-session", …), what the
// receiver needs to know of it, and its descriptors.
type Record struct {
	Kind string          `json:"kind"`
	Meta json.RawMessage `json:"meta,omitempty"`
	// NFiles is how many of the message's descriptors are this record's, in order.
	NFiles int        `json:"files,omitempty"`
	Files  []*os.File `json:"-"`
}

// NewRecord returns a record of kind whose Meta is meta encoded as JSON. Every file must be
// open: a record carries no placeholder for a socket it lacks (say so in meta instead).
func NewRecord(kind string, meta any, files ...*os.File) (Record, error) {
	for i, f := range files {
		if f == nil {
			return Record{}, fmt.Errorf("hand-over record %s: descriptor %d of %d is missing", kind, i+1, len(files))
		}
	}
	b, err := json.Marshal(meta)
	if err != nil {
		return Record{}, fmt.Errorf("hand-over record %s: %w", kind, err)
	}
	return Record{Kind: kind, Meta: b, NFiles: len(files), Files: files}, nil
}

// Package is everything handed over.
type Package struct {
	Records []Record
}

// Close closes every descriptor of the package that is still open (those not taken by setting
// the record's Files entry to nil).
func (p *Package) Close() {
	if p == nil {
		return
	}
	for _, r := range p.Records {
		closeFiles(r.Files)
	}
}

// Files returns how many descriptors the package holds.
func (p *Package) Files() int {
	n := 0
	for _, r := range p.Records {
		n += len(r.Files)
	}
	return n
}

type message struct {
	Type     string   `json:"type"`
	Versions []int    `json:"versions,omitempty"`
	Version  int      `json:"version,omitempty"`
	Reason   string   `json:"reason,omitempty"`
	PID      int      `json:"pid,omitempty"`
	Build    string   `json:"build,omitempty"`
	Records  []Record `json:"records,omitempty"`
	Total    int      `json:"total,omitempty"`
}

const (
	msgHello    = "hello"
	msgWelcome  = "welcome"
	msgRefuse   = "refuse"
	msgRecords  = "records"
	msgEnd      = "end"
	msgReady    = "ready"
	msgReleased = "released"
)

// ErrRefused is returned by Take when the predecessor answered but would not hand over
// (no common version, say); the reason follows it.
var ErrRefused = errors.New("hand-over refused")

// Giver is what the predecessor hands over: Listener.Serve calls it.
type Giver interface {
	// Freeze stops serving and returns everything to hand over, as duplicated descriptors.
	// On error the giver must still be serving (or resume by itself).
	Freeze(ctx context.Context) (*Package, error)
	// Release lets go of what Freeze froze: the giver closes its own descriptors without
	// touching the sockets and frees the instance lock. It does not serve again.
	Release()
	// Resume serves again after a hand-over that failed after Freeze; pkg is what Freeze
	// returned, its descriptors still open (Resume owns them).
	Resume(pkg *Package)
}

// LockGiver is a Giver whose instance lock travels to the successor (version 2): its
// Release then keeps the lock held until the released message, which carries LockFile's
// duplicate, has gone.
type LockGiver interface {
	Giver
	// LockFile returns a duplicate of the instance lock's descriptor: it holds the lock as the
	// original does (one open file), and the successor's copy goes on holding it. Release
	// closes the giver's own descriptor, not this one.
	LockFile() (*os.File, error)
}

// Claim takes the instance lock for a successor; an error while the predecessor still holds
// it. lock is the predecessor's lock descriptor when it handed the lock over (version 2):
// Claim keeps it (the lock is then the successor's, never free in between) or closes it. With
// nil, Claim takes the lock itself.
type Claim func(lock *os.File) error

// Path returns the hand-over socket of this network namespace in dir: one per namespace, as
// the instance lock is, so that proxies of other namespaces (tests, several nodes on one
// machine) never meet.
func Path(dir string) (string, error) {
	st, err := os.Stat("/proc/self/ns/net")
	if err != nil {
		return "", fmt.Errorf("hand-over socket: this network namespace: %w", err)
	}
	return filepath.Join(dir, fmt.Sprintf("handover-netns-%d.sock", inode(st))), nil
}

// Listener answers successors on the hand-over socket.
type Listener struct {
	ln   *net.UnixListener
	path string
	ino  uint64 // of the socket file Listen created
	log  zerolog.Logger
}

// Listen opens the hand-over socket at path, replacing a stale one: call it only while holding
// the instance lock, so that no live predecessor's socket is removed.
func Listen(path string, log zerolog.Logger) (*Listener, error) {
	if err := supported(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("hand-over socket: %w", err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("hand-over socket: removing the stale one: %w", err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("hand-over socket: %w", err)
	}
	ln.SetUnlinkOnClose(false) // removed by Close only while it is still ours
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("hand-over socket: %w", err)
	}
	st, err := os.Stat(path)
	if err != nil {
		ln.Close()
		return nil, fmt.Errorf("hand-over socket: %w", err)
	}
	return &Listener{ln: ln, path: path, ino: inode(st), log: log}, nil
}

// CloseHandedOver stops answering after a successor took over, leaving the socket path alone:
// the successor has put its own socket there, perhaps under the inode number this one's had,
// which Close could not tell apart.
func (l *Listener) CloseHandedOver() error { return l.ln.Close() }

// Close stops answering; the socket file is removed unless a successor has put its own in
// its place.
func (l *Listener) Close() error {
	err := l.ln.Close()
	if st, serr := os.Stat(l.path); serr == nil && inode(st) == l.ino {
		_ = os.Remove(l.path)
	}
	return err
}

// Serve answers successors one at a time until ctx is done or one takes everything over; it
// reports whether one did. Give Serve a ctx that ends with the process's shutdown.
func (l *Listener) Serve(ctx context.Context, g Giver, timeout time.Duration) bool {
	stop := context.AfterFunc(ctx, func() { _ = l.ln.SetDeadline(time.Now()) })
	defer stop()
	for {
		uc, err := l.ln.AcceptUnix()
		if err != nil {
			if ctx.Err() == nil {
				l.log.Error().Err(err).Msg("hand-over socket: accept failed; no successor can take over")
			}
			return false
		}
		if l.give(ctx, &conn{uc: uc}, g, timeout) {
			return true
		}
	}
}

// give runs one exchange with a successor and reports whether it took over.
func (l *Listener) give(ctx context.Context, c *conn, g Giver, timeout time.Duration) bool {
	defer c.uc.Close()
	_ = c.uc.SetDeadline(time.Now().Add(timeout))
	var hello message
	if files, err := c.recv(&hello); err != nil || hello.Type != msgHello {
		closeFiles(files)
		l.log.Warn().Err(err).Str("type", hello.Type).Msg("hand-over: a peer connected but did not say hello; still serving")
		return false
	}
	log := l.log.With().Int("successorPid", hello.PID).Str("successorBuild", hello.Build).Logger()
	v, ok := common(hello.Versions)
	if !ok {
		reason := fmt.Sprintf("no common protocol version: ours %v, the successor's %v", versions, hello.Versions)
		_ = c.send(message{Type: msgRefuse, Reason: reason}, nil)
		log.Warn().Msg("hand-over refused: " + reason + "; still serving")
		return false
	}
	if err := c.send(message{Type: msgWelcome, Version: v, PID: os.Getpid()}, nil); err != nil {
		log.Warn().Err(err).Msg("hand-over abandoned; still serving")
		return false
	}
	log.Info().Int("version", v).Msg("a successor asks to take over: freezing")
	start := time.Now()
	pkg, err := g.Freeze(ctx)
	if err != nil {
		log.Error().Err(err).Msg("hand-over: freezing failed; still serving")
		_ = c.send(message{Type: msgRefuse, Reason: "freezing failed: " + err.Error()}, nil)
		return false
	}
	err = sendPackage(c, pkg)
	if err == nil {
		var ready message
		var files []*os.File
		files, err = c.recv(&ready)
		closeFiles(files)
		if err == nil && ready.Type != msgReady {
			err = fmt.Errorf("the successor answered %q (%s) instead of ready", ready.Type, ready.Reason)
		}
	}
	if err != nil {
		log.Error().Err(err).Msg("hand-over failed before the successor was ready; serving again")
		g.Resume(pkg)
		return false
	}
	var lock []*os.File
	if lg, ok := g.(LockGiver); ok && v >= 2 {
		if f, err := lg.LockFile(); err != nil {
			log.Warn().Err(err).Msg("hand-over: cannot pass the instance lock on; the successor takes it once freed")
		} else {
			lock = []*os.File{f}
		}
	}
	g.Release()
	pkg.Close() // the successor has its own copies
	if err := c.send(message{Type: msgReleased}, lock); err != nil {
		log.Warn().Err(err).Msg("hand-over: telling the successor it may go on failed; it finds the instance lock free")
	}
	closeFiles(lock) // the successor's copy holds the lock now (or, gone, nobody's does)
	log.Info().Int("records", len(pkg.Records)).Dur("took", time.Since(start)).Msg("handed everything over to the successor")
	return true
}

// common returns the first of our versions the peer speaks.
func common(theirs []int) (int, bool) {
	for _, v := range versions {
		if slices.Contains(theirs, v) {
			return v, true
		}
	}
	return 0, false
}

// sendPackage sends pkg's records (see recordSender), then the end.
func sendPackage(c *conn, pkg *Package) error {
	rs := recordSender{c: c}
	for _, r := range pkg.Records {
		fds := make([]int, len(r.Files))
		for i, f := range r.Files {
			fd, err := rawFD(f)
			if err != nil {
				return fmt.Errorf("hand-over: record %s: %w", r.Kind, err)
			}
			fds[i] = fd
		}
		if err := rs.add(r, fds); err != nil {
			return err
		}
	}
	return rs.end()
}

// Take asks the predecessor listening at path to hand everything over and returns what it
// handed. claim takes the instance lock (an error while the predecessor still holds it): Take
// calls it after ready, and returns the package only once it succeeds, so that exactly one
// process serves. build names this one in the predecessor's log. A nil package and an error
// wrapping ErrRefused, or another error, mean nothing was taken over: the predecessor serves.
func Take(ctx context.Context, path, build string, claim Claim, log zerolog.Logger) (*Package, error) {
	if err := supported(); err != nil {
		return nil, err
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("hand-over: connecting to the running proxy: %w", err)
	}
	c := &conn{uc: nc.(*net.UnixConn)}
	defer c.uc.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.uc.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = c.uc.SetDeadline(time.Now()) })
	defer stop()
	if err := c.send(message{Type: msgHello, Versions: versions, PID: os.Getpid(), Build: build}, nil); err != nil {
		return nil, err
	}
	var welcome message
	if _, err := c.recv(&welcome); err != nil {
		return nil, err
	}
	switch welcome.Type {
	case msgWelcome:
	case msgRefuse:
		return nil, fmt.Errorf("%w: %s", ErrRefused, welcome.Reason)
	default:
		return nil, fmt.Errorf("hand-over: the running proxy answered %q", welcome.Type)
	}
	log.Info().Int("version", welcome.Version).Int("predecessorPid", welcome.PID).Msg("taking over from the running proxy")
	pkg, err := recvPackage(c)
	if err != nil {
		pkg.Close()
		return nil, err
	}
	if err := c.send(message{Type: msgReady}, nil); err != nil {
		pkg.Close()
		return nil, err
	}
	var released message
	files, rerr := c.recv(&released)
	ok := rerr == nil && released.Type == msgReleased
	if ok && welcome.Version >= 2 && len(files) == 1 {
		if err := claim(files[0]); err != nil {
			pkg.Close()
			return nil, fmt.Errorf("hand-over: the running proxy's instance lock: %w", err)
		}
		return pkg, nil
	}
	closeFiles(files)
	if err := claimWithin(ctx, func() error { return claim(nil) }, ok); err != nil {
		pkg.Close()
		return nil, fmt.Errorf("hand-over: the running proxy did not let go (%v): %w", rerr, err)
	}
	return pkg, nil
}

// claimWithin calls claim until it succeeds: a few times over a second when the predecessor
// said it let go (its lock is being freed), once otherwise (it either let go and died before
// saying so, or resumed and still holds the lock).
func claimWithin(ctx context.Context, claim func() error, released bool) error {
	tries := 1
	if released {
		tries = 20
	}
	var err error
	for i := range tries {
		if err = claim(); err == nil {
			return nil
		}
		if i < tries-1 {
			select {
			case <-ctx.Done():
				return errors.Join(err, ctx.Err())
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	return err
}

// recvPackage reads records messages until the end, handing each record its descriptors.
func recvPackage(c *conn) (*Package, error) {
	pkg := &Package{}
	for {
		var m message
		files, err := c.recv(&m)
		if err != nil {
			return pkg, err
		}
		switch m.Type {
		case msgEnd:
			closeFiles(files)
			if m.Total != len(pkg.Records) {
				return pkg, fmt.Errorf("hand-over: %d records received, the running proxy sent %d", len(pkg.Records), m.Total)
			}
			return pkg, nil
		case msgRecords:
		case msgRefuse:
			closeFiles(files)
			return pkg, fmt.Errorf("%w: %s", ErrRefused, m.Reason)
		default:
			closeFiles(files)
			return pkg, fmt.Errorf("hand-over: unexpected %q message", m.Type)
		}
		for _, r := range m.Records {
			if r.NFiles < 0 || r.NFiles > len(files) {
				closeFiles(files)
				return pkg, fmt.Errorf("hand-over: record %s names %d descriptors, %d left in its message", r.Kind, r.NFiles, len(files))
			}
			r.Files, files = files[:r.NFiles:r.NFiles], files[r.NFiles:]
			pkg.Records = append(pkg.Records, r)
		}
		if len(files) > 0 {
			closeFiles(files)
			return pkg, fmt.Errorf("hand-over: %d descriptors belong to no record", len(files))
		}
	}
}
