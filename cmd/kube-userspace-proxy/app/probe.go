package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"
)

// Readiness of this process, as opposed to the node's port.
//
// In a hostNetwork pod every process of the node shares the health port: during a rolling update
// the new pod's httpGet probe on 127.0.0.1:10256 is answered by the old proxy, which still holds
// the port until the hand-over moves it. The new pod would turn Ready before its own process
// serves anything, and the DaemonSet controller would delete the old pod while the new one is
// still starting. --ready-file and --probe-ready tell the processes apart: the serving process
// names itself in a file of its own container (/tmp is private to a container), and an exec
// probe run in the same container checks that file and /healthz.

// readyFile is the file (--ready-file) that names this process while it serves the node: from
// its first sync (holding the instance lock when it programs portals: Run syncs only then)
// until it freezes for a hand-over or begins to stop. A failed hand-over thaws it. The file holds
// the process's pid and start time (see procIdentity), so that a file an earlier process left
// behind (a crash, a restarted container whose proxy is PID 1 again) never counts. Its methods
// are safe for concurrent use and do nothing on a nil readyFile (no --ready-file).
type readyFile struct {
	path string
	log  zerolog.Logger
	self string // this process's identity, the file's content; "" when unknown

	mu sync.Mutex // guards the following fields
	// synced: the first sync is done. frozen: a hand-over is under way or done. stopped: the
	// process is shutting down or handed over for good; nothing is written again.
	synced, frozen, stopped bool
	written                 bool // the file is ours and in place
}

// newReadyFile returns the ready file at path, or nil when path is empty. A file an earlier
// process left at path stays until this one writes its own: it names a process that is gone,
// which the probe tells (and a proxy still serving beside this one may share the path).
func newReadyFile(path, procRoot string, log zerolog.Logger) *readyFile {
	if path == "" {
		return nil
	}
	r := &readyFile{path: path, log: log}
	id, err := procIdentity(procRoot, os.Getpid())
	if err != nil {
		log.Warn().Err(err).Str("readyFile", path).Msg("cannot name this process in the ready file: --probe-ready will fail")
	} else {
		r.self = id
	}
	return r
}

// markSynced records the first sync: the process serves the node from now on.
func (r *readyFile) markSynced() { r.update(func() { r.synced = true }) }

// freeze records that a hand-over begins: the successor is about to serve.
func (r *readyFile) freeze() { r.update(func() { r.frozen = true }) }

// thaw records a hand-over that failed: this process serves again.
func (r *readyFile) thaw() { r.update(func() { r.frozen = false }) }

// stop records the end: the process shuts down or has handed over.
func (r *readyFile) stop() { r.update(func() { r.stopped = true }) }

// update applies change and writes or removes the file to match.
func (r *readyFile) update(change func()) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	change()
	serving := r.synced && !r.frozen && !r.stopped && r.self != ""
	switch {
	case serving && !r.written:
		if err := writeFileAtomic(r.path, []byte(r.self+"\n")); err != nil {
			r.log.Warn().Err(err).Msg("writing the ready file: --probe-ready fails until the next change")
			return
		}
		r.written = true
		r.log.Debug().Str("readyFile", r.path).Msg("serving the node: ready file written")
	case !serving && r.written:
		// Only our own file: a successor that shares the path writes its own after our freeze.
		if err := os.Remove(r.path); err != nil && !errors.Is(err, os.ErrNotExist) {
			r.log.Warn().Err(err).Msg("removing the ready file")
			return
		}
		r.written = false
		r.log.Debug().Str("readyFile", r.path).Msg("no longer serving the node: ready file removed")
	}
}

// writeFileAtomic replaces path with data: a reader sees the old file or the new one, whole.
func writeFileAtomic(path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("ready file %s: %w", path, err)
	}
	_, werr := tmp.Write(data)
	if err := errors.Join(werr, tmp.Close()); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("ready file %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("ready file %s: %w", path, err)
	}
	return nil
}

// procIdentity returns "PID STARTTIME": the process's id and its start time in clock ticks
// since boot (field 22 of /proc/PID/stat), which together name one process for the life of
// the PID namespace: a pid is reused only by a later process.
func procIdentity(procRoot string, pid int) (string, error) {
	data, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "stat"))
	if err != nil {
		return "", fmt.Errorf("process %d: %w", pid, err)
	}
	// The command name (field 2) is in parentheses and may hold spaces or parentheses itself:
	// the fields after it follow the last ')'.
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return "", fmt.Errorf("process %d: unreadable stat %q", pid, s)
	}
	fields := strings.Fields(s[i+1:])
	const startTime = 22 - 3 // fields[0] is field 3, the state
	if len(fields) <= startTime {
		return "", fmt.Errorf("process %d: stat has %d fields after the command name, want more than %d", pid, len(fields), startTime)
	}
	return strconv.Itoa(pid) + " " + fields[startTime], nil
}

// readyProbe is what --probe-ready checks.
type readyProbe struct {
	// File is the --ready-file of the proxy to check.
	File string
	// Healthz is host:port of its /healthz; empty checks the file alone.
	Healthz string
	// ProcRoot is where processes are looked up; empty means /proc.
	ProcRoot string
	// Client fetches /healthz; nil means a client with a timeout of probeTimeout.
	Client *http.Client
}

// probeTimeout bounds the /healthz request of --probe-ready (the DaemonSet's probe allows more).
const probeTimeout = 3 * time.Second

// errNotServing: the ready file names no running process of this container.
var errNotServing = errors.New("this container's proxy does not serve the node")

// check returns nil when the file names a running process (the pid it names has the start time
// it records) and /healthz answers 200; otherwise an error saying which part failed.
func (p readyProbe) check(ctx context.Context) error {
	data, err := os.ReadFile(p.File)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("%w: no ready file %s (starting, taking over, handed over or stopping)", errNotServing, p.File)
	}
	if err != nil {
		return fmt.Errorf("ready file: %w", err)
	}
	want := strings.TrimSpace(string(data))
	pidStr, _, ok := strings.Cut(want, " ")
	pid, err := strconv.Atoi(pidStr)
	if !ok || err != nil || pid <= 0 {
		return fmt.Errorf("ready file %s: %q is not \"PID STARTTIME\"", p.File, want)
	}
	procRoot := p.ProcRoot
	if procRoot == "" {
		procRoot = "/proc"
	}
	got, err := procIdentity(procRoot, pid)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("%w: ready file %s names process %d, which is gone (a file of an earlier process)", errNotServing, p.File, pid)
	}
	if err != nil {
		return fmt.Errorf("ready file %s: %w", p.File, err)
	}
	if got != want {
		return fmt.Errorf("%w: ready file %s names process %q, but pid %d is now %q (a file of an earlier process)", errNotServing, p.File, want, pid, got)
	}
	if p.Healthz == "" {
		return nil
	}
	return p.checkHealthz(ctx)
}

// checkHealthz asks /healthz and wants 200; the body of another answer goes into the error (it
// says why: "nodeEligible": false, say).
func (p readyProbe) checkHealthz(ctx context.Context) error {
	client := p.Client
	if client == nil {
		client = &http.Client{Timeout: probeTimeout}
	}
	url := "http://" + p.Healthz + "/healthz"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("/healthz: %w", err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("/healthz: %w", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s answered %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}

// probeHealthzAddr returns where --probe-ready asks /healthz for a --healthz-bind-address:
// loopback of the same family for an unspecified address, "" when the server is disabled.
func probeHealthzAddr(bind string) (string, error) {
	if bind == "" {
		return "", nil
	}
	ap, err := netip.ParseAddrPort(bind)
	if err != nil {
		return "", fmt.Errorf("--healthz-bind-address: %q is not IP:port", bind)
	}
	addr := ap.Addr()
	switch {
	case addr.IsUnspecified() && addr.Is4():
		addr = netip.AddrFrom4([4]byte{127, 0, 0, 1})
	case addr.IsUnspecified():
		addr = netip.IPv6Loopback()
	}
	return netip.AddrPortFrom(addr, ap.Port()).String(), nil
}

// probeMain is --probe-ready: it checks this container's proxy and returns the exit code, 0
// when it serves the node, with the reason on stdout otherwise (the kubelet shows a failed
// probe's output in the pod's events).
func probeMain(opts *Options, stdout io.Writer) int {
	if opts.ReadyFile == "" {
		fmt.Fprintln(stdout, "--probe-ready needs --ready-file: the file the proxy of this container writes")
		return 2
	}
	healthz, err := probeHealthzAddr(opts.HealthzBindAddress)
	if err != nil {
		fmt.Fprintln(stdout, err)
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	if err := (readyProbe{File: opts.ReadyFile, Healthz: healthz}).check(ctx); err != nil {
		fmt.Fprintln(stdout, "not ready:", err)
		return 1
	}
	return 0
}
