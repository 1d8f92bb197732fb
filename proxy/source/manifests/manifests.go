// Package manifests is the source of Services and EndpointSlices that reads a directory of
// Kubernetes manifests instead of talking to an API server: the proxy on a laptop, in CI, or
// anywhere the services are known in advance.
//
// Every *.yaml, *.yml and *.json file directly in the directory is read (not subdirectories;
// dotfiles and editor backup files such as "#x.yaml#" or "x.yaml~" are ignored; symlinks are
// followed, so a mounted ConfigMap works). YAML files may hold several documents separated by
// "---"; JSON files hold one object or a v1 List. Services (v1) and EndpointSlices
// (discovery.k8s.io/v1) are decoded strictly into the k8s.io/api types: unknown, duplicate and
// mistyped fields are errors naming the field. A v1 List, ServiceList or EndpointSliceList is
// unpacked. Other kinds (Deployments, ConfigMaps, …) are ignored with a debug log.
//
// What the API server would do is done here: defaults (namespace "default", type ClusterIP,
// protocol TCP, targetPort = port, sessionAffinity None and its 10800 s timeout,
// internalTrafficPolicy Cluster, externalTrafficPolicy Cluster for NodePort and LoadBalancer,
// ipFamilyPolicy SingleStack and ipFamilies from the cluster IPs), validation of what the proxy
// depends on, and allocation of missing cluster IPs and node ports (see allocate.go for the
// deterministic scheme).
//
// A manifests directory has no Node, so this node's zone is unknown and the endpoints' topology
// hints (hints.forZones) are ignored, as kube-proxy ignores them on a node without a
// topology.kubernetes.io/zone label; node hints (hints.forNodes) still apply, matched against the
// node name. Other kinds, Node included, are ignored.
//
// Errors never stop the source: a broken object is logged once per file content (file,
// document, object, field) and skipped, and its last good version keeps serving; when a
// document is too broken to tell which object it was (a YAML or JSON syntax error, a file that
// is not YAML at all, a second YAML document hidden after a "..." end marker or on a "---" line,
// which the YAML library would silently drop), every object the file held before keeps serving
// until the file decodes again, and an error line naming the file says so. At most 20 errors are
// logged per read of a file, then one line "and K more errors in FILE"; the documents are decoded
// one at a time and only those 20 errors are held, so a file of a million broken documents costs
// neither a million log lines nor the memory to hold them.
//
// Changes are found by scans: the directory is listed and each file's size, modification time
// and inode compared. On Linux an inotify watch on the directory wakes a scan as soon as a file
// is renamed into it, created, closed after a write, deleted, moved away or has its attributes
// changed, and when a ConfigMap volume swaps its "..data" symlink (see watch.go); the directory is
// also polled, every 10×Interval while the watch works and every Interval when it cannot be set
// up, when the directory is gone (it is watched again once it is back), or on a network file
// system, where changes made elsewhere raise no event. An overflow of the event queue makes a
// full rescan. A new or changed file is read only once it has kept the
// same size, modification time and inode for Debounce (300 ms by default; the file is looked at
// again when it is due), and its stat after the read must still be the same; so a file rewritten
// in place (truncated, then written) is not read while half-written. On a file system with
// sub-second timestamps the modification time tells how long a file has been unchanged, so a
// file last written more than Debounce ago is read as soon as it is seen: at start, the files
// written before are read and delivered by the first scan. (A network file system whose server
// clock lags by more than Debounce could make a file being written look settled; the stat after
// the read still catches a write during the read.) Likewise a file's objects are deleted only
// once it has been missing for Debounce. A writer that pauses longer than Debounce in the middle
// of a file defeats this: write files by rename (to a temporary file in the same directory, then
// mv), which is atomic. A file renamed into the directory (IN_MOVED_TO: an atomic write) is
// complete at once and read without waiting for Debounce, and so are the files of a ConfigMap
// volume (symlinks) when its "..data" symlink is swapped; should such a file be written to
// between the event and the end of its read, it waits for Debounce as any file written in place.
// A file closed after a write in place (IN_CLOSE_WRITE) is not taken as settled: a writer may
// open it again (a shell script appending line by line does), so it waits for Debounce from its
// last modification, as it would have when found by polling. A read file's content hash is compared, and only changed content is
// decoded; within it, documents whose bytes are unchanged are not decoded again (see docCache).
// The files read by one scan are decoded in parallel (see parallel.go). Files modified within
// the last two seconds before they were read are read again on the next scans until they
// settle, so a same-size rewrite within the file system's timestamp granularity is not missed.
// An idle scan costs one stat per file. Merging what the files hold (duplicates, cluster IP and
// node port allocation) looks only at the objects whose version changed, unless the last merge
// found a problem (see incremental.go): one more service in a directory of 10,000 is delivered
// ~9 ms after its file is read, not ~110 ms.
package manifests

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/equality"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source"
)

// DefaultServiceCIDR is the cluster IP range when Options.ServiceCIDRs is empty
// (kube-apiserver's usual --service-cluster-ip-range).
var DefaultServiceCIDR = netip.MustParsePrefix("10.96.0.0/16")

// DefaultInterval is the rescan period when Options.Interval is 0.
const DefaultInterval = time.Second

// DefaultDebounce is how long a changed file must stay unchanged before it is read, when
// Options.Debounce is 0.
const DefaultDebounce = 300 * time.Millisecond

// settleWaits bounds the wait for files still being written at start: OnSynced is called at
// the latest settleWaits×Debounce after the first scan, without the files that have not settled.
const settleWaits = 10

// racyWindow: a file whose modification time is this close to (or after) the moment it was read
// is read again on the next scan, whatever its size and mtime say.
const racyWindow = 2 * time.Second

// mtimeSlack is how far a file system's timestamp of a write may lag behind the real time of
// the write (its clock advances once per kernel tick).
const mtimeSlack = 20 * time.Millisecond

// unchangedSince returns since when a file seen now with a new stat of modification time mtime
// is known to be unchanged. When the file system keeps sub-second timestamps, that is its
// last write (a file written long ago is settled when first seen: the first state is read at
// once); with whole-second timestamps (or one set by hand, or a modification time in the
// future) it is now, and the file must be seen unchanged for Debounce.
func unchangedSince(mtime, now time.Time) time.Time {
	if mtime.Nanosecond() == 0 {
		return now
	}
	if t := mtime.Add(mtimeSlack); t.Before(now) {
		return t
	}
	return now
}

// Options configures a Source. The zero value is valid.
type Options struct {
	// ServiceCIDRs are the ranges cluster IPs are allocated from: at most one IPv4 and one IPv6
	// prefix, the first being the primary family (as kube-apiserver's
	// --service-cluster-ip-range). Empty means DefaultServiceCIDR.
	ServiceCIDRs []netip.Prefix
	// Interval is how often the directory is rescanned when it cannot be watched (no inotify,
	// the directory gone, a network file system); while it is watched, every 10×Interval. 0
	// means DefaultInterval.
	Interval time.Duration
	// Debounce is how long a new or changed file must keep the same size, modification time and
	// inode before it is read, so that a file being written in place is not read half-written.
	// The file is looked at again when it is due, not at the next Interval. 0 means
	// DefaultDebounce.
	Debounce time.Duration
	// Log receives the source's logs. The zero value discards them.
	Log zerolog.Logger
}

func validateCIDRs(cidrs []netip.Prefix) error {
	if len(cidrs) > 2 {
		return fmt.Errorf("at most two CIDRs (one per IP family), got %d", len(cidrs))
	}
	for _, p := range cidrs {
		if !p.IsValid() {
			return fmt.Errorf("invalid CIDR %v", p)
		}
		if p.Addr().Is4In6() {
			return fmt.Errorf("CIDR %s: IPv4-mapped IPv6 is not supported", p)
		}
		if _, err := newIPRange(p); err != nil {
			return err
		}
	}
	if len(cidrs) == 2 && cidrs[0].Addr().Is4() == cidrs[1].Addr().Is4() {
		return fmt.Errorf("CIDRs %s and %s are of the same IP family; dual-stack needs one IPv4 and one IPv6", cidrs[0], cidrs[1])
	}
	return nil
}

// Validate reports whether the options are usable.
func (o *Options) Validate() error {
	if err := validateCIDRs(o.ServiceCIDRs); err != nil {
		return fmt.Errorf("service CIDRs: %w", err)
	}
	if o.Interval < 0 {
		return fmt.Errorf("interval %v is negative", o.Interval)
	}
	if o.Debounce < 0 {
		return fmt.Errorf("debounce %v is negative", o.Debounce)
	}
	return nil
}

func (o *Options) serviceCIDRs() []netip.Prefix {
	if len(o.ServiceCIDRs) == 0 {
		return []netip.Prefix{DefaultServiceCIDR}
	}
	out := make([]netip.Prefix, len(o.ServiceCIDRs))
	for i, p := range o.ServiceCIDRs {
		out[i] = p.Masked()
	}
	return out
}

func (o *Options) interval() time.Duration {
	if o.Interval <= 0 {
		return DefaultInterval
	}
	return o.Interval
}

func (o *Options) debounce() time.Duration {
	if o.Debounce <= 0 {
		return DefaultDebounce
	}
	return o.Debounce
}

// Source serves the manifests of one directory. Create it with New; Run it once.
type Source struct {
	dir  string
	opts Options
	log  zerolog.Logger
	dec  *decoder
	// now is the clock of the debounce; tests replace it.
	now func() time.Time
	// scanned, when set (by tests), is called after each of Run's rescans.
	scanned func()
	// newWatcher sets up the inotify watch; tests replace it.
	newWatcher func(dir string, log zerolog.Logger) (*watcher, error)
	// watchedPoll, when set (by tests), is the poll period while the directory is watched.
	watchedPoll time.Duration

	started atomic.Bool // Run was called

	// The fields below are owned by Run's goroutine.
	alloc     *allocator
	files     map[string]*fileState // by file name (not path)
	delivered map[objKey]*delivered
	allocated allocation
	// reported holds the cross-file problems logged by the last merge, so each is logged once.
	reported map[string]bool
	// inc is what the delivered services hold when the last merge found no problem, for the
	// next merge to be an incremental one (see incremental.go); nil otherwise. touched holds the
	// keys whose version changed since the last merge.
	inc     *owners
	touched map[objKey]bool
	// fullMergesOnly (set by tests) turns the incremental merge off; incrementalMerges counts
	// the merges that were incremental.
	fullMergesOnly    bool
	incrementalMerges int
	dirErr            string // last error listing the directory, logged once
	watch             *watcher
	hint              *hints // what the watcher saw before the current scan; nil for the first
}

// fileState is what the source knows about one file.
type fileState struct {
	stat    statKey // when last read
	racy    bool    // read too soon after its last modification: read again next scan
	sum     [sha256.Size]byte
	decoded bool // sum is the hash of decoded content
	readErr string
	objects map[objKey]*entry

	// seen is the stat last observed, and seenSince when it was first observed (by s.now): the
	// file is read once it has been seen unchanged for Debounce.
	seen      statKey
	seenSince time.Time
	// missingSince is when the file was first found missing (zero while it exists): its objects
	// are deleted once it has been missing for Debounce.
	missingSince time.Time
}

// statKey is what a stat tells about a file's content without reading it.
type statKey struct {
	size  int64
	mtime time.Time
	ino   uint64
	dev   uint64
}

func statKeyOf(fi os.FileInfo) statKey {
	k := statKey{size: fi.Size(), mtime: fi.ModTime()}
	k.ino, k.dev = fileID(fi)
	return k
}

// delivered is an object as last handed to the Handler.
type delivered struct {
	svc   *v1.Service
	from  *v1.Service // the decoded service svc was allocated from
	slice *sliceDoc
	file  string
}

// New returns a Source for the manifests in dir. Nothing is read until Run.
func New(dir string, opts Options) *Source {
	return &Source{
		dir:        dir,
		opts:       opts,
		log:        opts.Log.With().Str("source", "manifests").Str("dir", dir).Logger(),
		dec:        newDecoder(),
		now:        time.Now,
		newWatcher: newWatcher,
		files:      map[string]*fileState{},
		delivered:  map[objKey]*delivered{},
		reported:   map[string]bool{},
	}
}

// Run scans the directory, delivers its objects to h, calls h.OnSynced, then rescans every
// Interval, or at once when the directory is watched and changes (see the package doc), and
// delivers the differences (adds, updates, deletes) until ctx is done, when it returns nil (the
// watch's goroutine has then returned and its descriptors are closed). A file is read once it has been unchanged for Debounce (by its modification
// time, see unchangedSince, or as seen by the scans), so files written long before the start
// are delivered by the first scan; OnSynced waits for the files present at start to settle,
// but not longer than settleWaits×Debounce. All Handler calls are made from Run's
// goroutine. Run returns an error when the options are invalid, when the directory cannot be
// read at the first scan, or when called twice; later failures to read the directory are logged
// and the objects keep serving.
func (s *Source) Run(ctx context.Context, h source.Handler) error {
	if !s.started.CompareAndSwap(false, true) {
		return errors.New("manifests: Run called more than once")
	}

	if err := s.prepare(); err != nil {
		return err
	}
	// The watch comes before the first scan, so that no change after that scan goes unseen.
	s.startWatch()
	defer s.stopWatch()
	due, err := s.scan(h, true)
	if err != nil {
		return err
	}
	timer := time.NewTimer(s.pollInterval())
	defer timer.Stop()
	// wait waits until the next scan is due: at next, when the watcher sees a change, or after
	// the poll interval when next is zero or later. It returns false when ctx is done.
	wait := func(next time.Time) bool {
		d := s.pollInterval()
		if !next.IsZero() {
			d = min(d, max(next.Sub(s.now()), 0))
		}
		timer.Reset(d) // since Go 1.23 no stale tick can be received after Reset
		select {
		case <-ctx.Done():
			return false
		case <-timer.C:
			return true
		case <-s.wakeups():
			return true
		}
	}
	rescan := func() {
		s.hint = s.takeHints()
		due, _ = s.scan(h, false)
		s.hint = nil
		if s.scanned != nil {
			s.scanned()
		}
	}
	limit := s.now().Add(settleWaits * s.opts.debounce())
	for !due.IsZero() && due.Before(limit) {
		if !wait(due) {
			return nil
		}
		rescan()
	}
	ev, msg := s.log.Info(), "initial scan delivered; watching for changes"
	if unsettled := s.unsettled(); len(unsettled) > 0 {
		ev, msg = s.log.Warn().Strs("unsettledFiles", unsettled), "initial scan delivered without the files still being written; they are read once they settle"
	}
	ev.Int("files", len(s.files)).Int("objects", len(s.delivered)).Dur("interval", s.opts.interval()).
		Dur("debounce", s.opts.debounce()).Msg(msg)
	h.OnSynced()

	for wait(due) {
		rescan()
	}
	return nil
}

// unsettled returns the paths of the files waiting to settle before their first read.
func (s *Source) unsettled() []string {
	var out []string
	for name, st := range s.files {
		if !st.decoded && st.readErr == "" {
			out = append(out, filepath.Join(s.dir, name))
		}
	}
	sort.Strings(out)
	return out
}

// prepare validates the options and builds the allocator.
func (s *Source) prepare() error {
	if err := s.opts.Validate(); err != nil {
		return fmt.Errorf("manifests: %w", err)
	}
	alloc, err := newAllocator(s.opts.serviceCIDRs())
	if err != nil {
		return fmt.Errorf("manifests: %w", err)
	}
	s.alloc = alloc
	return nil
}

// isManifestFile reports whether a directory entry name is one the source reads.
func isManifestFile(name string) bool {
	if name == "" || strings.ContainsAny(name[:1], ".#~") || strings.HasSuffix(name, "~") || strings.HasSuffix(name, "#") {
		return false
	}
	switch strings.ToLower(filepath.Ext(name)) {
	case ".yaml", ".yml", ".json":
		return true
	}
	return false
}

// scan looks at the directory once, reads the files that changed and have settled (been seen
// unchanged for Debounce, or known complete by s.hint), and delivers what changed. A file that has disappeared is treated
// likewise: its objects are deleted once it has been missing for Debounce, so that an editor
// that moves a file aside before writing it anew does not delete and re-add its services. scan
// returns when the next file waiting to settle is due (zero when none is), and an error only when
// the directory cannot be listed at the first scan.
func (s *Source) scan(h source.Handler, first bool) (time.Time, error) {
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		if first {
			return time.Time{}, fmt.Errorf("manifests: read directory %s: %w", s.dir, err)
		}
		if msg := err.Error(); msg != s.dirErr {
			s.dirErr = msg
			s.log.Error().Err(err).Msg("cannot read the manifest directory; everything keeps serving as it is")
		}
		return time.Time{}, nil
	}
	if s.dirErr != "" {
		s.dirErr = ""
		s.log.Info().Msg("manifest directory readable again")
	}

	now, debounce := s.now(), s.opts.debounce()
	var due time.Time
	waitUntil := func(t time.Time) {
		if due.IsZero() || t.Before(due) {
			due = t
		}
	}
	changed := first
	seen := make(map[string]bool, len(entries))
	var loads []*load
	for _, de := range entries {
		name := de.Name()
		if !isManifestFile(name) {
			continue
		}
		path := filepath.Join(s.dir, name)
		fi, err := os.Stat(path) // follows symlinks
		if errors.Is(err, os.ErrNotExist) {
			continue // gone since the listing, or a dangling symlink: as if deleted
		}
		if err == nil && !fi.Mode().IsRegular() {
			continue // a directory or device named like a manifest
		}
		seen[name] = true
		complete := false // known whole by a rename (see hints)
		st := s.files[name]
		if st == nil {
			st = &fileState{}
			s.files[name] = st
		}
		st.missingSince = time.Time{}
		if err == nil {
			k := statKeyOf(fi)
			if k != st.seen || st.seenSince.IsZero() {
				st.seen, st.seenSince = k, unchangedSince(k.mtime, now)
			}
			if st.decoded && !st.racy && st.stat == k {
				continue
			}
			if complete = s.hint.complete(name, isSymlink(de)); complete {
				if t := now.Add(-debounce); st.seenSince.After(t) {
					st.seenSince = t // whole: settled now
				}
			} else if settled := st.seenSince.Add(debounce); now.Before(settled) {
				waitUntil(settled) // still changing, or not yet seen unchanged for long enough
				continue
			}
		}
		l := s.load(path, st, fi, err)
		l.complete = complete
		loads = append(loads, l)
	}
	s.recheck(loads)
	s.decodeLoads(loads)
	for _, l := range loads {
		read, settled := s.apply(l)
		if read {
			changed = true
		}
		if !settled {
			waitUntil(l.st.seenSince.Add(debounce))
		}
	}
	for name, st := range s.files {
		if seen[name] {
			continue
		}
		if st.missingSince.IsZero() {
			st.missingSince = now
		}
		if gone := st.missingSince.Add(debounce); now.Before(gone) && len(st.objects) > 0 {
			waitUntil(gone)
			continue
		}
		delete(s.files, name)
		s.noteTouched(st.objects, nil)
		if len(st.objects) > 0 {
			changed = true
			s.log.Info().Str("file", filepath.Join(s.dir, name)).Msg("file removed; its objects are deleted")
		}
	}
	if changed && !s.mergeChanged(h) {
		s.merge(h)
	}
	releaseDecoded(loads)
	return due, nil
}

// load is one file read by a scan: read and hashed (load), decoded if its content changed
// (decodeLoads, in parallel with the other files), then applied to its fileState (apply). Only
// apply changes the fileState, so that the files are applied, and logged, in order.
type load struct {
	path      string
	st        *fileState
	fi        os.FileInfo
	readStart time.Time
	err       error // of the stat or the read
	after     statKey
	sum       [sha256.Size]byte
	data      []byte      // nil once decoded
	res       *fileResult // nil when the content is not decoded: an error, or unchanged
	complete  bool        // read without Debounce, known whole by a hint
	suspect   bool        // complete, but written to since the hint: may be half-written
}

// load reads one file. statErr is the error of the stat fi, if any.
func (s *Source) load(path string, st *fileState, fi os.FileInfo, statErr error) *load {
	l := &load{path: path, st: st, fi: fi, readStart: time.Now(), err: statErr}
	switch {
	case l.err == nil && fi.Size() > maxFileSize:
		l.err = errTooLarge // not worth reading
	case l.err == nil:
		l.data, l.after, l.err = readLimited(path)
	}
	if l.err == nil {
		l.sum = sha256.Sum256(l.data)
	}
	return l
}

// decodeLoads decodes the content of the loads that need it (read whole, unchanged while read,
// and not what was decoded last), in parallel.
func (s *Source) decodeLoads(loads []*load) {
	var jobs []*fileJob
	var todo []*load
	for _, l := range loads {
		if l.err != nil || l.suspect || statKeyOf(l.fi) != l.after || (l.st.decoded && l.sum == l.st.sum) {
			continue
		}
		prev := l.st.objects
		jobs = append(jobs, &fileJob{path: l.path, isJSON: strings.EqualFold(filepath.Ext(l.path), ".json"), data: l.data,
			track: func(k objKey) bool { return prev[k] != nil }, cache: cacheOf(prev)})
		todo = append(todo, l)
	}
	for i, res := range s.dec.decodeFiles(jobs, 0) {
		todo[i].res, todo[i].data = res, nil
	}
}

// apply records what a load found in its file's state and logs it. It reports whether the
// file's objects may have changed, and whether the file was settled: a file that changed while
// it was read is left to settle again.
func (s *Source) apply(l *load) (read, settled bool) {
	st := l.st
	if l.err != nil {
		// Keep whatever the file served; say so once per distinct error.
		if msg := l.err.Error(); msg != st.readErr {
			st.readErr = msg
			s.log.Error().Str("file", l.path).Err(l.err).Int("keptObjects", len(st.objects)).
				Msg("cannot read manifest file; its last good objects keep serving")
		}
		st.decoded = false
		return false, true
	}
	st.readErr = ""
	if k := statKeyOf(l.fi); l.after != k || l.suspect {
		// Written to while being read (or since it was known complete): what was read may be
		// half of it.
		st.seen, st.seenSince = l.after, s.now()
		return false, false
	}
	st.stat = l.after
	st.racy = !l.fi.ModTime().Before(l.readStart.Add(-racyWindow))
	if l.res == nil {
		return false, true // the content decoded last
	}
	st.sum, st.decoded = l.sum, true

	res, prev := l.res, st.objects
	next := make(map[objKey]*entry, len(res.objects))
	for _, e := range res.objects {
		next[e.key] = e
	}
	kept := 0
	for _, k := range res.failed {
		if p, ok := prev[k]; ok && next[k] == nil {
			next[k] = keep(p)
			kept++
		}
	}
	if res.unidentified {
		for k, p := range prev {
			if next[k] == nil {
				next[k] = keep(p)
				kept++
			}
		}
	}
	s.noteTouched(prev, next)
	st.objects = next
	s.logResult(l.path, res, kept)
	return true, true
}

// logResult logs what decoding a file's content found: its first maxErrorsKept errors (and
// documents of other kinds, at debug level), then one summary line, which counts the errors
// that were not logged. So one read of a file logs at most maxErrorsKept+1 lines at info level
// and above, however broken the file.
func (s *Source) logResult(path string, res *fileResult, kept int) {
	for _, e := range res.errs {
		ev := s.log.Error().Str("file", e.File).Str("where", e.Where())
		if e.Object != "" {
			ev = ev.Str("object", e.Object)
		}
		if e.Field != "" {
			ev = ev.Str("field", e.Field)
		}
		ev.Msg(e.Detail)
	}
	for _, sk := range res.skipped {
		s.log.Debug().Str("file", path).Str("where", sk.where).Str("apiVersion", sk.apiVersion).Str("kind", sk.kind).
			Str("name", sk.name).Msg("ignoring object of a kind this source does not serve")
	}
	var ev *zerolog.Event
	var msg string
	switch {
	case res.errCount == 0:
		ev, msg = s.log.Info(), "manifest file loaded"
	case res.unidentified && kept > 0:
		ev, msg = s.log.Error(), "manifest file cannot be decoded in full; the objects of its last good content that are not in the part decoded keep serving"
	case kept > 0:
		ev, msg = s.log.Warn(), "manifest file loaded with errors; the objects in error keep their last good version"
	default:
		ev, msg = s.log.Warn(), "manifest file loaded with errors; the objects in error are not served"
	}
	if more := res.errCount - len(res.errs); more > 0 {
		msg = fmt.Sprintf("and %d more errors in %s (not logged); %s", more, path, msg)
	}
	ev.Str("file", path).Int("objects", len(res.objects)).Int("errors", res.errCount).Int("keptFromBefore", kept).
		Int("ignored", res.skippedCount).Msg(msg)
}

// keep returns p marked as kept from an earlier content of its file.
func keep(p *entry) *entry {
	if p.stale {
		return p
	}
	c := *p
	c.stale = true
	return &c
}

var errTooLarge = fmt.Errorf("file is larger than the limit of %d bytes", maxFileSize)

// readLimited reads a file of at most maxFileSize bytes. It returns what a stat of the open
// file says after the read, to tell whether the file changed while it was read.
func readLimited(path string) ([]byte, statKey, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, statKey{}, err
	}
	defer f.Close()
	var buf bytes.Buffer
	if fi, err := f.Stat(); err == nil && fi.Size() <= maxFileSize {
		buf.Grow(int(fi.Size()) + bytes.MinRead) // one allocation for a file not being written
	}
	if _, err := buf.ReadFrom(io.LimitReader(f, maxFileSize+1)); err != nil {
		return nil, statKey{}, err
	}
	data := buf.Bytes()
	if len(data) > maxFileSize {
		return nil, statKey{}, errTooLarge
	}
	fi, err := f.Stat()
	if err != nil {
		return nil, statKey{}, err
	}
	return data, statKeyOf(fi), nil
}

// candidate is one file's claim on an object.
type candidate struct {
	file string
	e    *entry
}

// compareKeys orders objKeys as their String forms would sort, without building them.
func compareKeys(a, b objKey) int {
	return cmp.Or(strings.Compare(a.Kind, b.Kind), strings.Compare(a.Namespace, b.Namespace), strings.Compare(a.Name, b.Name))
}

// claims returns, for every object, the file whose version is served (see pick), the version,
// and the cross-file problems.
func (s *Source) claims() (map[objKey]candidate, []problem) {
	names := make([]string, 0, len(s.files))
	total := 0
	for name, st := range s.files {
		names = append(names, name)
		total += len(st.objects)
	}
	sort.Strings(names)
	want := make(map[objKey]candidate, total)
	var dups map[objKey][]candidate // objects claimed by more than one file, in file name order
	for _, name := range names {
		for k, e := range s.files[name].objects {
			c := candidate{file: name, e: e}
			first, ok := want[k]
			if !ok {
				want[k] = c
				continue
			}
			if dups == nil {
				dups = map[objKey][]candidate{}
			}
			if dups[k] == nil {
				dups[k] = []candidate{first}
			}
			dups[k] = append(dups[k], c)
		}
	}
	var problems []problem
	for _, k := range slices.SortedFunc(maps.Keys(dups), compareKeys) {
		want[k] = s.pick(k, dups[k], &problems)
	}
	return want, problems
}

// merge combines the files' objects, resolves duplicates, allocates, and delivers the
// differences from what was delivered before.
func (s *Source) merge(h source.Handler) {
	want, problems := s.claims()

	// Services: allocate across all of them, in key order.
	var svcKeys []objKey
	for k, c := range want {
		if c.e.svc != nil {
			svcKeys = append(svcKeys, k)
		}
	}
	slices.SortFunc(svcKeys, compareKeys)
	svcs := make([]*v1.Service, len(svcKeys))
	for i, k := range svcKeys {
		svcs[i] = want[k].e.svc
	}
	done, next, aps := s.alloc.allocate(svcs, s.allocated)
	s.allocated = next
	final := make(map[objKey]*delivered, len(want))
	for i, k := range svcKeys {
		prev := s.delivered[k]
		switch {
		case done[i] == nil && prev != nil:
			final[k] = prev // a fatal allocation problem: the last delivered version keeps serving
		case done[i] == nil:
		case prev != nil && prev.from == svcs[i] && sameAllocation(prev.svc, done[i]):
			final[k] = &delivered{svc: prev.svc, from: svcs[i], file: want[k].file} // unchanged: one object per version
		default:
			final[k] = &delivered{svc: done[i], from: svcs[i], file: want[k].file}
		}
	}
	for _, ap := range aps {
		lvl := zerolog.WarnLevel
		if ap.fatal {
			lvl = zerolog.ErrorLevel
		}
		problems = append(problems, problem{level: lvl, object: ap.key.String(), file: filepath.Join(s.dir, want[ap.key].file), msg: ap.msg})
	}
	for k, c := range want {
		if c.e.slice != nil {
			final[k] = &delivered{slice: c.e.slice, file: c.file}
		}
	}
	s.report(problems)
	s.deliver(h, final)
	s.touched, s.inc = nil, nil
	if len(problems) == 0 {
		s.inc = ownersOf(final)
	}
}

// pick chooses which file's version of an object is served. Fresh versions beat versions kept
// from an earlier content of a broken file. Among several fresh ones (a real duplicate, reported)
// the file that served the object last time wins, else the file whose name sorts first.
func (s *Source) pick(k objKey, cs []candidate, problems *[]problem) candidate {
	if len(cs) == 1 {
		return cs[0]
	}
	var fresh []candidate
	for _, c := range cs {
		if !c.e.stale {
			fresh = append(fresh, c)
		}
	}
	switch len(fresh) {
	case 0:
		fresh = cs
	case 1:
		return fresh[0]
	}
	win := fresh[0] // cs is in file name order
	if d := s.delivered[k]; d != nil {
		for _, c := range fresh {
			if c.file == d.file {
				win = c
			}
		}
	}
	var where []string
	for _, c := range fresh {
		where = append(where, filepath.Join(s.dir, c.file)+" ("+c.e.pos.where()+")")
	}
	*problems = append(*problems, problem{level: zerolog.ErrorLevel, object: k.String(), file: filepath.Join(s.dir, win.file),
		msg: "defined in more than one file: " + strings.Join(where, " and ") + "; serving the one in " + filepath.Join(s.dir, win.file)})
	return win
}

// problem is a cross-file problem found by merge.
type problem struct {
	level  zerolog.Level
	object string
	file   string
	msg    string
}

// maxProblemLines bounds the problems one merge logs a line each for; the rest are counted in
// one more line. A directory of 10,000 services with ClusterIPs outside the service CIDRs
// would otherwise log 10,000 warnings at every start.
const maxProblemLines = 20

// report logs the problems that were not already logged by the previous merge: the first
// maxProblemLines a line each, then how many more there are, at the most severe level among
// them.
func (s *Source) report(problems []problem) {
	now := make(map[string]bool, len(problems))
	logged, more := 0, 0
	var moreLevel zerolog.Level
	for _, p := range problems {
		id := p.object + "\x00" + p.msg
		now[id] = true
		if s.reported[id] {
			continue
		}
		if logged == maxProblemLines {
			if more == 0 || p.level > moreLevel {
				moreLevel = p.level
			}
			more++
			continue
		}
		logged++
		s.log.WithLevel(p.level).Str("object", p.object).Str("file", p.file).Msg(p.msg)
	}
	if more > 0 {
		s.log.WithLevel(moreLevel).Int("problems", more).Int("logged", logged).
			Msgf("%d more objects have problems like those above; not logged one by one", more)
	}
	s.reported = now
}

// deliver hands the differences between s.delivered and final to h and makes final the
// delivered state (see deliverKeys). Only the objects that differ are sorted; an object
// delivered before is compared by identity first (unchanged files and documents keep their
// objects), deeply only when that fails.
func (s *Source) deliver(h source.Handler, final map[objKey]*delivered) {
	var keys []objKey
	for k, cur := range final {
		if !s.unchanged(k, cur) {
			keys = append(keys, k)
		}
	}
	for k := range s.delivered {
		if final[k] == nil {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(keys, compareKeys)
	s.deliverKeys(h, keys, func(k objKey) *delivered { return final[k] })
	s.delivered = final
}

// deliverChanges hands h the changes of the objects keys (sorted), each to its version in
// changes (nil: deleted), and records them in s.delivered.
func (s *Source) deliverChanges(h source.Handler, keys []objKey, changes map[objKey]*delivered) {
	differ := keys[:0:0]
	for _, k := range keys {
		if cur := changes[k]; (cur != nil || s.delivered[k] != nil) && !s.unchanged(k, cur) {
			differ = append(differ, k)
		}
	}
	s.deliverKeys(h, differ, func(k objKey) *delivered { return changes[k] })
	for _, k := range keys {
		if cur := changes[k]; cur != nil {
			s.delivered[k] = cur
		} else {
			delete(s.delivered, k)
		}
	}
}

// unchanged reports whether cur (nil: deleted) is the version of k delivered last, and if so
// makes it hand out the same object (one object per version).
func (s *Source) unchanged(k objKey, cur *delivered) bool {
	prev := s.delivered[k]
	switch {
	case prev == nil || cur == nil:
		return false
	case prev.svc != nil && cur.svc != nil && (prev.svc == cur.svc || equality.Semantic.DeepEqual(prev.svc, cur.svc)):
		cur.svc = prev.svc
		return true
	case prev.slice != nil && cur.slice != nil && prev.slice.same(cur.slice):
		cur.slice = prev.slice
		return true
	}
	return false
}

// deliverKeys hands h the change of each of keys (sorted) from s.delivered to cur. Order:
// services, then slices (adds and updates), then slice deletes, then service deletes, each in
// key order.
func (s *Source) deliverKeys(h source.Handler, keys []objKey, cur func(objKey) *delivered) {
	var adds, updates, deletes int
	for _, pass := range []struct {
		kind    string
		deletes bool
	}{{kindService, false}, {kindEndpointSlice, false}, {kindEndpointSlice, true}, {kindService, true}} {
		for _, k := range keys {
			if k.Kind != pass.kind {
				continue
			}
			prev, cur := s.delivered[k], cur(k)
			switch {
			case cur == nil && pass.deletes:
				deletes++
				if k.Kind == kindService {
					h.OnServiceUpdate(prev.svc, nil)
				} else if p, ok := s.sliceOf(k, prev); ok {
					h.OnEndpointSliceUpdate(p, nil)
				}
			case cur == nil || pass.deletes:
			case prev == nil:
				adds++
				if k.Kind == kindService {
					h.OnServiceUpdate(nil, cur.svc)
				} else if c, ok := s.sliceOf(k, cur); ok {
					h.OnEndpointSliceUpdate(nil, c)
				}
			case k.Kind == kindService:
				updates++
				h.OnServiceUpdate(prev.svc, cur.svc)
			default:
				updates++
				p, okp := s.sliceOf(k, prev)
				c, okc := s.sliceOf(k, cur)
				if okp && okc {
					h.OnEndpointSliceUpdate(p, c)
				}
			}
		}
	}
	if adds+updates+deletes > 0 {
		s.log.Info().Int("added", adds).Int("updated", updates).Int("deleted", deletes).Msg("delivered changes")
	}
}

// sliceOf returns the EndpointSlice d holds (decoded again when it was released, see sliceDoc).
// That cannot fail for an encoding of a decoded object; should it, the error is logged and ok is false:
// the change is not delivered, and the version delivered before keeps serving.
func (s *Source) sliceOf(k objKey, d *delivered) (*discovery.EndpointSlice, bool) {
	obj, err := s.dec.slice(d.slice)
	if err != nil {
		s.log.Error().Err(err).Str("object", k.String()).Str("file", filepath.Join(s.dir, d.file)).
			Msg("internal error: an EndpointSlice kept by the source does not decode again; its change is not delivered")
		return nil, false
	}
	return obj, true
}

// releaseDecoded lets go of the decoded EndpointSlices of loads once they have been merged and
// delivered: the source keeps their encoding, the proxy what they contribute (see sliceDoc).
func releaseDecoded(loads []*load) {
	for _, l := range loads {
		if l.res == nil {
			continue
		}
		for _, e := range l.res.objects {
			if e.slice != nil {
				e.slice.release()
			}
		}
	}
}
