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
// document is too broken to tell which object it was, every object the file held before keeps
// serving until the file decodes again.
//
// Changes are found by polling: every Interval the directory is listed and each file's size,
// modification time and inode compared; a changed file is read and its content hash compared;
// changed content is decoded. Files modified within the last two seconds before they were read
// are read again on the next scans until they settle, so a same-size rewrite within the file
// system's timestamp granularity is not missed. Polling was chosen over inotify because it is
// simple, needs no extra dependency and works on every file system (network mounts, ConfigMap
// volumes that swap symlinks); at the default of one second it costs one stat per file.
package manifests

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
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

// racyWindow: a file whose modification time is this close to (or after) the moment it was read
// is read again on the next scan, whatever its size and mtime say.
const racyWindow = 2 * time.Second

// Options configures a Source. The zero value is valid.
type Options struct {
	// ServiceCIDRs are the ranges cluster IPs are allocated from: at most one IPv4 and one IPv6
	// prefix, the first being the primary family (as kube-apiserver's
	// --service-cluster-ip-range; see ParseServiceCIDRs). Empty means DefaultServiceCIDR.
	ServiceCIDRs []netip.Prefix
	// Interval is how often the directory is rescanned. 0 means DefaultInterval.
	Interval time.Duration
	// Log receives the source's logs. The zero value discards them.
	Log zerolog.Logger
}

// ParseServiceCIDRs parses kube-apiserver's --service-cluster-ip-range syntax: one CIDR, or an
// IPv4 and an IPv6 CIDR separated by a comma (the first is the primary family).
func ParseServiceCIDRs(s string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, part := range strings.Split(s, ",") {
		p, err := netip.ParsePrefix(strings.TrimSpace(part))
		if err != nil {
			return nil, fmt.Errorf("parse service CIDRs %q: %w", s, err)
		}
		out = append(out, p)
	}
	if err := validateCIDRs(out); err != nil {
		return nil, fmt.Errorf("parse service CIDRs %q: %w", s, err)
	}
	return out, nil
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

// Source serves the manifests of one directory. Create it with New; Run it once.
type Source struct {
	dir  string
	opts Options
	log  zerolog.Logger
	dec  *decoder

	mu      sync.Mutex // guards started
	started bool

	// The fields below are owned by Run's goroutine.
	alloc     *allocator
	files     map[string]*fileState // by file name (not path)
	delivered map[objKey]*delivered
	allocated allocation
	// reported holds the cross-file problems logged by the last merge, so each is logged once.
	reported map[string]bool
	dirErr   string // last error listing the directory, logged once
}

// fileState is what the source knows about one file.
type fileState struct {
	stat    statKey
	racy    bool // read too soon after its last modification: read again next scan
	sum     [sha256.Size]byte
	decoded bool // sum is the hash of decoded content
	readErr string
	objects map[objKey]*entry
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
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		k.ino, k.dev = uint64(st.Ino), uint64(st.Dev)
	}
	return k
}

// delivered is an object as last handed to the Handler.
type delivered struct {
	svc   *v1.Service
	slice *discovery.EndpointSlice
	file  string
}

// New returns a Source for the manifests in dir. Nothing is read until Run.
func New(dir string, opts Options) *Source {
	return &Source{
		dir:       dir,
		opts:      opts,
		log:       opts.Log.With().Str("source", "manifests").Str("dir", dir).Logger(),
		dec:       newDecoder(),
		files:     map[string]*fileState{},
		delivered: map[objKey]*delivered{},
		reported:  map[string]bool{},
	}
}

// Run scans the directory, delivers its objects to h, calls h.OnSynced, then rescans every
// Interval and delivers the differences (adds, updates, deletes) until ctx is done, when it
// returns nil. All Handler calls are made from Run's goroutine. Run returns an error when the
// options are invalid, when the directory cannot be read at the first scan, or when called twice;
// later failures to read the directory are logged and the objects keep serving.
func (s *Source) Run(ctx context.Context, h source.Handler) error {
	s.mu.Lock()
	if s.started {
		s.mu.Unlock()
		return errors.New("manifests: Run called more than once")
	}
	s.started = true
	s.mu.Unlock()

	if err := s.prepare(); err != nil {
		return err
	}
	if err := s.scan(h, true); err != nil {
		return err
	}
	h.OnSynced()
	s.log.Info().Int("files", len(s.files)).Int("objects", len(s.delivered)).Dur("interval", s.opts.interval()).
		Msg("initial scan delivered; watching for changes")

	t := time.NewTicker(s.opts.interval())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			_ = s.scan(h, false)
		}
	}
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

// scan looks at the directory once and delivers what changed. It returns an error only when the
// directory cannot be listed at the first scan.
func (s *Source) scan(h source.Handler, first bool) error {
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		if first {
			return fmt.Errorf("manifests: read directory %s: %w", s.dir, err)
		}
		if msg := err.Error(); msg != s.dirErr {
			s.dirErr = msg
			s.log.Error().Err(err).Msg("cannot read the manifest directory; everything keeps serving as it is")
		}
		return nil
	}
	if s.dirErr != "" {
		s.dirErr = ""
		s.log.Info().Msg("manifest directory readable again")
	}

	changed := first
	seen := map[string]bool{}
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
		st := s.files[name]
		if st == nil {
			st = &fileState{}
			s.files[name] = st
			changed = true
		}
		if err == nil && st.decoded && !st.racy && st.stat == statKeyOf(fi) {
			continue
		}
		if s.readFile(path, st, fi, err) {
			changed = true
		}
	}
	for name := range s.files {
		if !seen[name] {
			delete(s.files, name)
			changed = true
			s.log.Info().Str("file", filepath.Join(s.dir, name)).Msg("file removed; its objects are deleted")
		}
	}
	if changed {
		s.merge(h)
	}
	return nil
}

// readFile reads and, if its content changed, decodes one file. statErr is the error of the
// stat, if any. It reports whether the file's objects may have changed.
func (s *Source) readFile(path string, st *fileState, fi os.FileInfo, statErr error) bool {
	readStart := time.Now()
	var data []byte
	err := statErr
	if err == nil {
		data, err = readLimited(path)
	}
	if err != nil {
		// Keep whatever the file served; say so once per distinct error.
		if msg := err.Error(); msg != st.readErr {
			st.readErr = msg
			s.log.Error().Str("file", path).Err(err).Int("keptObjects", len(st.objects)).
				Msg("cannot read manifest file; its last good objects keep serving")
		}
		st.decoded = false
		return false
	}
	st.readErr = ""
	st.stat = statKeyOf(fi)
	st.racy = !fi.ModTime().Before(readStart.Add(-racyWindow))
	sum := sha256.Sum256(data)
	if st.decoded && sum == st.sum {
		return false
	}
	st.sum, st.decoded = sum, true

	res := s.dec.decodeFile(path, strings.EqualFold(filepath.Ext(path), ".json"), data)
	prev := st.objects
	next := map[objKey]*entry{}
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
	st.objects = next

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
	ev := s.log.Info()
	if len(res.errs) > 0 {
		ev = s.log.Warn()
	}
	ev.Str("file", path).Int("objects", len(res.objects)).Int("errors", len(res.errs)).Int("keptFromBefore", kept).
		Int("ignored", len(res.skipped)).Msg("manifest file loaded")
	return true
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

// readLimited reads a file of at most maxFileSize bytes.
func readLimited(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxFileSize+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxFileSize {
		return nil, fmt.Errorf("file is larger than the limit of %d bytes", maxFileSize)
	}
	return data, nil
}

// candidate is one file's claim on an object.
type candidate struct {
	file string
	e    *entry
}

// merge combines the files' objects, resolves duplicates, allocates, and delivers the
// differences from what was delivered before.
func (s *Source) merge(h source.Handler) {
	var problems []problem
	claims := map[objKey][]candidate{}
	names := make([]string, 0, len(s.files))
	for name := range s.files {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		for k, e := range s.files[name].objects {
			claims[k] = append(claims[k], candidate{file: name, e: e})
		}
	}

	want := map[objKey]*entry{}
	wantFile := map[objKey]string{}
	for k, cs := range claims {
		c := s.pick(k, cs, &problems)
		want[k], wantFile[k] = c.e, c.file
	}

	// Services: allocate across all of them, in key order.
	var svcKeys []objKey
	for k, e := range want {
		if e.svc != nil {
			svcKeys = append(svcKeys, k)
		}
	}
	sort.Slice(svcKeys, func(i, j int) bool { return svcKeys[i].String() < svcKeys[j].String() })
	svcs := make([]*v1.Service, len(svcKeys))
	for i, k := range svcKeys {
		svcs[i] = want[k].svc
	}
	done, next, aps := s.alloc.allocate(svcs, s.allocated)
	s.allocated = next
	final := map[objKey]*delivered{}
	for i, k := range svcKeys {
		if done[i] != nil {
			final[k] = &delivered{svc: done[i], file: wantFile[k]}
		} else if d := s.delivered[k]; d != nil {
			final[k] = d // a fatal allocation problem: the last delivered version keeps serving
		}
	}
	for _, ap := range aps {
		lvl := zerolog.WarnLevel
		if ap.fatal {
			lvl = zerolog.ErrorLevel
		}
		problems = append(problems, problem{level: lvl, object: ap.key.String(), file: filepath.Join(s.dir, wantFile[ap.key]), msg: ap.msg})
	}
	for k, e := range want {
		if e.slice != nil {
			final[k] = &delivered{slice: e.slice, file: wantFile[k]}
		}
	}
	s.report(problems)
	s.deliver(h, final)
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
		where = append(where, filepath.Join(s.dir, c.file)+" ("+c.e.where+")")
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

// report logs the problems that were not already logged by the previous merge.
func (s *Source) report(problems []problem) {
	now := map[string]bool{}
	for _, p := range problems {
		id := p.object + "\x00" + p.msg
		now[id] = true
		if s.reported[id] {
			continue
		}
		s.log.WithLevel(p.level).Str("object", p.object).Str("file", p.file).Msg(p.msg)
	}
	s.reported = now
}

// deliver hands the differences between s.delivered and final to h and makes final the
// delivered state. Order: services, then slices (adds and updates), then slice deletes, then
// service deletes, each in key order.
func (s *Source) deliver(h source.Handler, final map[objKey]*delivered) {
	keys := make([]objKey, 0, len(final)+len(s.delivered))
	for k := range final {
		keys = append(keys, k)
	}
	for k := range s.delivered {
		if final[k] == nil {
			keys = append(keys, k)
		}
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].String() < keys[j].String() })
	var adds, updates, deletes int
	for _, pass := range []struct {
		kind    string
		deletes bool
	}{{kindService, false}, {kindEndpointSlice, false}, {kindEndpointSlice, true}, {kindService, true}} {
		for _, k := range keys {
			if k.Kind != pass.kind {
				continue
			}
			prev, cur := s.delivered[k], final[k]
			switch {
			case cur == nil && pass.deletes:
				deletes++
				if k.Kind == kindService {
					h.OnServiceUpdate(prev.svc, nil)
				} else {
					h.OnEndpointSliceUpdate(prev.slice, nil)
				}
			case cur == nil || pass.deletes:
			case prev == nil:
				adds++
				if k.Kind == kindService {
					h.OnServiceUpdate(nil, cur.svc)
				} else {
					h.OnEndpointSliceUpdate(nil, cur.slice)
				}
			case k.Kind == kindService:
				if equality.Semantic.DeepEqual(prev.svc, cur.svc) {
					cur.svc = prev.svc // hand out one object per version
					continue
				}
				updates++
				h.OnServiceUpdate(prev.svc, cur.svc)
			default:
				if equality.Semantic.DeepEqual(prev.slice, cur.slice) {
					cur.slice = prev.slice
					continue
				}
				updates++
				h.OnEndpointSliceUpdate(prev.slice, cur.slice)
			}
		}
	}
	s.delivered = final
	if adds+updates+deletes > 0 {
		s.log.Info().Int("added", adds).Int("updated", updates).Int("deleted", deletes).Msg("delivered changes")
	}
}
