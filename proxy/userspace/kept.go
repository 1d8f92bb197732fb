package userspace

import (
	"fmt"
	"syscall"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
)

// The listener store (handover.Store, kept by a holder process beside the proxy) keeps
// duplicates of the proxier's listening sockets, so that they outlive a crash: KeptListeners
// says what to keep after each sync, and a restarted proxier takes them back with AdoptKept.

// KeptListeners returns the proxier's open listening sockets, for the listener store: the
// service port, its protocol and proxy port, and the socket (read through SyscallConn; a
// socket closed by a sync since fails there, and is left out). None while frozen or closed.
func (p *Proxier) KeptListeners() []handover.KeptListener {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || p.frozen {
		return nil
	}
	out := make([]handover.KeptListener, 0, len(p.ports))
	for name, l := range p.ports {
		var c syscall.Conn
		switch {
		case !l.isOpen() || l.frozen:
			continue
		case l.tcp != nil:
			c = l.tcp.Listener
		case l.udp != nil:
			c = l.udp.Conn
		default:
			continue
		}
		out = append(out, handover.KeptListener{
			Meta: handover.ListenerMeta{Name: name, Protocol: l.protocol(), ProxyPort: l.proxyPort},
			Conn: c,
		})
	}
	return out
}

// AdoptKept takes listening sockets a holder kept for the proxy before this one, as Adopt
// takes a predecessor's listeners: each waits for the sync that opens its service port, and
// what no sync wants is closed at the end of the first. Each socket is checked first: a
// listening TCP socket or an unconnected UDP socket of the record's protocol, bound to this
// proxier's bind address and the record's proxy port, in this network namespace, and not a
// service port already adopted. One that is not is logged, closed, and left to a cold start.
// Call it before Run, after Adopt (a hand-over's listeners take precedence). Records it
// looked at have their Files set to nil. It returns how many it took.
func (p *Proxier) AdoptKept(recs []handover.Record) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	taken := 0
	for i := range recs {
		r := &recs[i]
		err := p.checkKeptLocked(r)
		if err == nil {
			_, err = p.adoptLocked(r)
		}
		if err != nil {
			p.log.Warn().Err(err).Msg("a listener the holder kept is not usable: closed; its service port opens anew")
			for _, f := range r.Files {
				_ = f.Close()
			}
		} else {
			taken++
		}
		r.Files = nil
	}
	return taken
}

// checkKeptLocked checks a record the holder kept (see AdoptKept).
func (p *Proxier) checkKeptLocked(r *handover.Record) error {
	var m handover.ListenerMeta
	if err := r.Decode(&m, 1, 1); err != nil {
		return err
	}
	if r.Kind != handover.KindListener {
		return fmt.Errorf("a %s record from the holder, want %s", r.Kind, handover.KindListener)
	}
	if m.Protocol != v1.ProtocolTCP && m.Protocol != v1.ProtocolUDP {
		return fmt.Errorf("listener of %s: protocol %q", m.Name, m.Protocol)
	}
	if m.ProxyPort <= 0 || m.ProxyPort > 65535 {
		return fmt.Errorf("listener of %s %s: proxy port %d", m.Name, m.Protocol, m.ProxyPort)
	}
	if _, dup := p.stash[listenerKey{m.Name, m.Protocol}]; dup {
		return fmt.Errorf("listener of %s %s: the service port has one already", m.Name, m.Protocol)
	}
	if err := checkProxySocket(r.Files[0], m.Protocol, listenAddr(p.opts.BindAddress, m.ProxyPort)); err != nil {
		return fmt.Errorf("listener of %s %s on proxy port %d: %w", m.Name, m.Protocol, m.ProxyPort, err)
	}
	return nil
}
