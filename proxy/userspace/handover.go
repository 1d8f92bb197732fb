package userspace

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/loadbalancer"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/tcp"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/udp"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
)

// The records a Proxier hands over are package handover's: KindListener, KindTCPConn,
// KindUDPSession, KindHeld and KindAffinity. Listener records come before the connections and
// sessions of their listener.

// listenerKey names a listener across processes.
type listenerKey struct {
	name  proxy.Name
	proto v1.Protocol
}

// inherited is a listener handed over by a predecessor (or by this proxier's own Freeze, on
// Resume), waiting for the sync that opens its service port.
type inherited struct {
	proxyPort int
	sock      *os.File
	conns     []forward.TCPConnState
	sessions  []forward.UDPSessionState
}

// close drops what nobody took: the listening socket, and every connection reset.
func (in *inherited) close() {
	_ = in.sock.Close()
	for _, c := range in.conns {
		resetFile(c.Client)
		resetFile(c.Backend)
	}
	for _, s := range in.sessions {
		_ = s.Backend.Close()
	}
}

// Freeze stops the proxier for a hand-over: no more syncs, no more accepting, every connection
// and session stopped at a safe point. It returns everything as records with duplicated
// descriptors: the successor Adopts them. On error the proxier serves again. After Freeze,
// either Release (the successor took over) or Resume (it did not) must follow.
func (p *Proxier) Freeze(ctx context.Context) ([]handover.Record, error) {
	p.syncMu.Lock()
	defer p.syncMu.Unlock()
	p.mu.Lock()
	if p.closed || p.frozen {
		p.mu.Unlock()
		return nil, errors.New("freeze proxier: closed or frozen already")
	}
	if err := p.handoverRoomLocked(); err != nil {
		p.mu.Unlock()
		return nil, fmt.Errorf("freeze proxier: %w", err)
	}
	p.frozen = true
	recs, err := p.freezeLocked(ctx)
	p.mu.Unlock()
	if err != nil {
		p.Resume(recs)
		return nil, err
	}
	return recs, nil
}

// thawLocked serves again on the proxier's own sockets after a hand-over that failed: every
// frozen listener thaws in place (its connections and sessions relay on where they stopped)
// and serves again. It needs no descriptor, so it works where the failure was running out of
// them.
func (p *Proxier) thawLocked() {
	for _, l := range p.ports {
		if !l.frozen {
			continue
		}
		l.frozen = false
		var err error
		switch {
		case l.tcp != nil:
			if err = l.tcp.Thaw(); err == nil {
				l.serveTCP(&p.listen)
			}
		case l.udp != nil:
			if err = l.udp.Thaw(); err == nil {
				l.serveUDP(&p.listen)
			}
		}
		if err != nil {
			l.logError().Err(err).Msg("cannot serve again after the failed hand-over; the next sync opens the port anew")
			l.close(p.alloc, p.opts.Metrics)
			p.stale = true
		}
	}
}

// handoverMargin is what a hand-over leaves free of the open-files limit beyond the duplicates
// it needs: descriptors that other work (a sync, a health check, new pipes) may take meanwhile.
const handoverMargin = 64

// handoverRoomLocked checks, before anything is frozen, that the process can duplicate every
// socket a freeze exports (the listeners, both sockets of each connection, each UDP session's,
// the held ports) within its open-files limit: a freeze that ran out of descriptors halfway
// would have to undo what it froze. Without a file limit it checks nothing.
func (p *Proxier) handoverRoomLocked() error {
	limit := p.opts.Limits.FileLimit
	if limit <= 0 {
		return nil
	}
	need := p.budget.InUse() + len(p.holder.held) // the data path's sockets (pipes are not sent: an over-estimate)
	for _, l := range p.ports {
		if l.isOpen() {
			need++
		}
	}
	open, err := p.openFDs()
	if err != nil {
		return fmt.Errorf("count open descriptors: %w", err)
	}
	if open+need+handoverMargin > limit {
		return fmt.Errorf("a hand-over would duplicate %d descriptors, and %d of the open-files limit %d are open: "+
			"not enough room (raise the limit, or restart instead: the successor then waits for this proxy to exit)", need, open, limit)
	}
	return nil
}

// openFDCount counts this process's open descriptors.
func openFDCount() (int, error) {
	d, err := os.Open("/proc/self/fd")
	if err != nil {
		return 0, err
	}
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return 0, err
	}
	return len(names) - 1, nil // less the directory's own descriptor
}

// freezeLocked freezes every open listener, the held ports and the affinity table. On error it
// returns what it froze so far, for Resume.
func (p *Proxier) freezeLocked(ctx context.Context) ([]handover.Record, error) {
	rs := &records{hook: p.testHookRecord}
	for name, l := range p.ports {
		if err := l.freeze(ctx, name, rs); err != nil {
			return rs.recs, fmt.Errorf("freeze %s: %w", l.choose.sp.Load(), err)
		}
	}
	for k, c := range p.holder.held {
		f, err := dupCloser(c)
		if err != nil {
			return rs.recs, fmt.Errorf("freeze held port %s: %w", k, err)
		}
		if err := rs.add(handover.KindHeld, handover.HeldMeta{Protocol: k.proto, Addr: k.addr, Port: k.port}, f); err != nil {
			return rs.recs, err
		}
	}
	byPort := map[proxy.Name][]loadbalancer.AffinityEntry{}
	for _, e := range p.lb.Affinity() {
		byPort[e.Port] = append(byPort[e.Port], e)
	}
	for _, entries := range byPort {
		if err := rs.add(handover.KindAffinity, entries); err != nil {
			return rs.recs, err
		}
	}
	return rs.recs, nil
}

// records collects the records of a freeze.
type records struct {
	recs []handover.Record
	hook func(kind string) error // Proxier.testHookRecord
}

// add adds a record of kind; on error its files are closed.
func (rs *records) add(kind string, meta any, files ...*os.File) error {
	r, err := handover.NewRecord(kind, meta, files...)
	if err != nil {
		for _, f := range files {
			if f != nil {
				_ = f.Close()
			}
		}
		return err
	}
	return rs.keep(r, nil)
}

// keep adds r, made by one of package handover's record constructors (which closed its files
// on error); on error its files are closed.
func (rs *records) keep(r handover.Record, err error) error {
	if err == nil && rs.hook != nil {
		if err = rs.hook(r.Kind); err != nil {
			for _, f := range r.Files {
				_ = f.Close()
			}
		}
	}
	if err != nil {
		return err
	}
	rs.recs = append(rs.recs, r)
	return nil
}

// freeze freezes the listener (if open) and adds its records: the listener first, then its
// connections or sessions.
func (l *listener) freeze(ctx context.Context, name proxy.Name, rs *records) error {
	lm := handover.ListenerMeta{Name: name, Protocol: l.protocol(), ProxyPort: l.proxyPort}
	switch {
	case l.tcp != nil:
		l.frozen = true // even when Freeze fails: it leaves the proxy frozen
		st, err := l.tcp.Freeze(ctx)
		if err != nil {
			return err
		}
		if err := rs.add(handover.KindListener, lm, st.Listener); err != nil {
			_ = forward.TCPState{Conns: st.Conns}.Close() // the duplicates no record took
			return err
		}
		for i, c := range st.Conns {
			if err := rs.keep(handover.TCPConnRecord(name, c)); err != nil {
				_ = forward.TCPState{Conns: st.Conns[i+1:]}.Close()
				return err
			}
		}
	case l.udp != nil:
		l.frozen = true
		st, err := l.udp.Freeze(ctx)
		if err != nil {
			return err
		}
		if err := rs.add(handover.KindListener, lm, st.Conn); err != nil {
			_ = forward.UDPState{Sessions: st.Sessions}.Close()
			return err
		}
		for i, s := range st.Sessions {
			if err := rs.keep(handover.UDPSessionRecord(name, s)); err != nil {
				_ = forward.UDPState{Sessions: st.Sessions[i+1:]}.Close()
				return err
			}
		}
	}
	return nil
}

// dupCloser duplicates the descriptor of a held port's socket.
func dupCloser(c io.Closer) (*os.File, error) {
	type filer interface{ File() (*os.File, error) }
	switch s := c.(type) {
	case *os.File:
		return handover.Dup(s)
	case filer:
		return s.File()
	}
	return nil, fmt.Errorf("cannot duplicate a %T", c)
}

// Release lets go of what Freeze froze, once the successor has it: the proxier closes its own
// descriptors (the sockets live on in the successor), and serves nothing from then on. Run and
// Shutdown then return at once.
func (p *Proxier) Release() {
	p.mu.Lock()
	p.releaseFrozenLocked()
	p.closed = true
	poller := p.listen.poller // no listener is watched any more (closeListeners does nothing now)
	p.listen.poller = nil
	p.mu.Unlock()
	if poller != nil {
		_ = poller.Close()
	}
}

// releaseFrozenLocked closes the frozen listeners' and held ports' own descriptors.
func (p *Proxier) releaseFrozenLocked() {
	for _, l := range p.ports {
		switch {
		case l.tcp != nil:
			l.tcp.Release()
		case l.udp != nil:
			l.udp.Release()
		}
		l.release(p.alloc)
	}
	p.gen++
	p.stale = true
	p.holder.closeAll()
}

// Resume serves again after a hand-over that failed after Freeze: recs are what Freeze
// returned. The proxier thaws in place — the same sockets, listeners and connections, not a
// descriptor more — closes the duplicates in recs, and syncs what changed meanwhile.
func (p *Proxier) Resume(recs []handover.Record) {
	for i := range recs {
		for _, f := range recs[i].Files {
			if f != nil {
				_ = f.Close() // a duplicate: the socket lives on in this process
			}
		}
		recs[i].Files = nil
	}
	p.mu.Lock()
	p.thawLocked()
	p.frozen = false
	p.mu.Unlock()
	p.log.Info().Int("records", len(recs)).Msg("hand-over failed: serving again on the same sockets")
	p.runner.Trigger()
}

// Adopt takes the records a predecessor handed over (those of the kinds above; others are left
// to the caller): listeners with their connections and sessions wait for the sync that opens
// their service port, held ports for the sync that holds them, affinity entries for their
// port's first balancer update. What no sync takes is closed (connections reset) at the end of
// the next sync. Adopt the records before Run. Records it takes have their Files set to nil;
// a record it cannot use is logged and its descriptors closed.
func (p *Proxier) Adopt(recs []handover.Record) {
	p.mu.Lock()
	defer p.mu.Unlock()
	counts := map[string]int{}
	for i := range recs {
		r := &recs[i]
		ok, err := p.adoptLocked(r)
		if !ok {
			continue
		}
		if err != nil {
			p.log.Error().Err(err).Str("kind", r.Kind).Msg("handed-over record not usable; dropped")
			for _, f := range r.Files {
				resetFile(f)
			}
		} else {
			counts[r.Kind]++
		}
		r.Files = nil
	}
	p.log.Info().Int("listeners", counts[handover.KindListener]).Int("tcpConnections", counts[handover.KindTCPConn]).
		Int("udpSessions", counts[handover.KindUDPSession]).Int("heldPorts", counts[handover.KindHeld]).
		Int("affinityPorts", counts[handover.KindAffinity]).Msg("adopted what the predecessor handed over")
}

// adoptLocked takes one record; ok is false for kinds that are not the proxier's.
func (p *Proxier) adoptLocked(r *handover.Record) (ok bool, err error) {
	switch r.Kind {
	case handover.KindListener:
		var m handover.ListenerMeta
		if err := r.Decode(&m, 1, 1); err != nil {
			return true, err
		}
		k := listenerKey{m.Name, m.Protocol}
		if old := p.stash[k]; old != nil {
			old.close()
		}
		p.alloc.Reserve(m.ProxyPort)
		p.stash[k] = &inherited{proxyPort: m.ProxyPort, sock: r.Files[0]}
	case handover.KindTCPConn:
		name, cs, err := r.TCPConn()
		if err != nil {
			return true, err
		}
		in := p.stash[listenerKey{name, v1.ProtocolTCP}]
		if in == nil {
			return true, fmt.Errorf("connection of %s: its listener was not handed over", name)
		}
		in.conns = append(in.conns, cs)
	case handover.KindUDPSession:
		name, s, err := r.UDPSession()
		if err != nil {
			return true, err
		}
		in := p.stash[listenerKey{name, v1.ProtocolUDP}]
		if in == nil {
			return true, fmt.Errorf("UDP session of %s: its listener was not handed over", name)
		}
		in.sessions = append(in.sessions, s)
	case handover.KindHeld:
		var m handover.HeldMeta
		if err := r.Decode(&m, 1, 1); err != nil {
			return true, err
		}
		p.holder.inherit(holdKey{proto: m.Protocol, addr: m.Addr, port: m.Port}, r.Files[0])
	case handover.KindAffinity:
		var entries []loadbalancer.AffinityEntry
		if err := r.Decode(&entries, 0, 0); err != nil {
			return true, err
		}
		p.lb.RestoreAffinity(entries)
	default:
		return false, nil
	}
	return true, nil
}

// takeInheritedLocked hands the listeners about to open what was handed over for them.
func (p *Proxier) takeInheritedLocked(ls []*listener) {
	if len(p.stash) == 0 {
		return
	}
	for _, l := range ls {
		sp := l.choose.sp.Load()
		k := listenerKey{sp.Name, sp.Protocol}
		if in := p.stash[k]; in != nil {
			l.inherit = in
			delete(p.stash, k)
		}
	}
}

// dropInheritedLocked closes what a sync left of the handed-over listeners: their service
// ports are gone (or could not open).
func (p *Proxier) dropInheritedLocked() {
	for k, in := range p.stash {
		p.log.Warn().Stringer("servicePort", k.name).Str("protocol", string(k.proto)).Int("connections", len(in.conns)).
			Int("sessions", len(in.sessions)).Msg("a handed-over listener's service port is not served any more: closed, its connections reset")
		p.alloc.Release(in.proxyPort)
		in.close()
		delete(p.stash, k)
	}
}

// openInherited takes the socket handed over for the listener, and keeps its connections and
// sessions for start; on error it closes them and the caller opens a new socket.
func (l *listener) openInherited(cfg *listenConfig, in *inherited, metrics forward.Metrics) error {
	sp := l.choose.sp.Load()
	if sp.Protocol == v1.ProtocolUDP {
		conn, err := udp.ConnFromFile(in.sock)
		if err != nil {
			in.close()
			return err
		}
		l.udp = l.newUDP(cfg, conn, metrics)
		l.adopt = &inherited{sessions: in.sessions}
		l.proxyPort = in.proxyPort
		return nil
	}
	ln, err := tcp.ListenerFromFile(in.sock)
	if err != nil {
		in.close()
		return err
	}
	l.tcp = l.newTCP(cfg, ln, metrics)
	l.adopt = &inherited{conns: in.conns}
	l.proxyPort = in.proxyPort
	return nil
}

// inherit takes a held port's socket handed over by a predecessor; the next reconcile keeps it
// if the port is still to be held, and closes it otherwise.
func (h *holder) inherit(k holdKey, f *os.File) {
	if old, ok := h.inherited[k]; ok {
		_ = old.Close()
	}
	h.inherited[k] = f
}
