package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/portalloc"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/serviceport"
)

// TrafficMetrics hands out the traffic-metrics sink of each service port.
type TrafficMetrics interface {
	ForPort(name serviceport.Name, protocol v1.Protocol) forward.Metrics
	// Forget drops a deleted service port's series.
	Forget(name serviceport.Name, protocol v1.Protocol)
}

// maxOpenAttempts bounds how many ports of the range one open tries before giving up until the
// next sync.
const maxOpenAttempts = 16

// listener is one service port's proxy listener and the forwarder serving it.
type listener struct {
	proxier *Proxier
	log     zerolog.Logger
	// sp is the port's current definition; swapped by the sync, read per connection.
	sp atomic.Pointer[serviceport.ServicePort]

	// The following fields are set by open and cleared by close, under Proxier.mu.
	proto     v1.Protocol
	proxyPort int // 0 while not open
	tcp       *forward.TCPProxy
	udp       *forward.UDPProxy
	served    sync.WaitGroup // the Serve goroutine
}

var _ forward.Chooser = (*listener)(nil)

func (l *listener) protocol() v1.Protocol { return l.sp.Load().Protocol }

// Choose picks the endpoint for a new connection or flow (forward.Chooser). Traffic whose
// original destination is not one of the ClusterIPs arrived on a NodePort, externalIP or LB IP
// and follows the external traffic policy.
//
// The target is transparent (dialled from the client's address) for external traffic of an
// externalTrafficPolicy: Local service to an endpoint on this node when Options.TransparentLocal
// is set, and carries the service's PROXY protocol setting whatever its policy.
func (l *listener) Choose(client, dst netip.AddrPort, reset bool) (forward.Target, error) {
	sp := l.sp.Load()
	external := dst.IsValid() && sp.UsesExternalPolicy(dst.Addr().Unmap())
	if external && sp.ExternalPolicyLocal && (l.proxier.isLocalAddr(client.Addr()) || l.proxier.isClusterAddr(client.Addr())) {
		// Traffic the node itself or a pod sends to a NodePort, externalIP or LB IP has no
		// client IP to preserve: like kube-proxy's "route LOCAL traffic ... to service chain"
		// rule (addrtype --src-type LOCAL) and its pod-traffic rule (-s cluster CIDR), it is
		// treated as ClusterIP traffic and may use endpoints on every node (subject to
		// internalTrafficPolicy).
		external = false
	}
	ep, err := l.proxier.lb.Next(sp.Name, client.Addr().Unmap(), external, reset)
	if err != nil {
		return forward.Target{}, err
	}
	// Dial from the client's address only where the endpoint's replies come back through this
	// node: external traffic of a Local service to an endpoint here (never Cluster policy or
	// remote endpoints, whose replies would bypass the proxy).
	transparent := l.proxier.opts.TransparentLocal && external && sp.ExternalPolicyLocal &&
		ep.NodeName != "" && ep.NodeName == l.proxier.opts.NodeName
	return forward.Target{Endpoint: ep.Addr, Transparent: transparent, ProxyProtocol: proxyProtocol(sp.ProxyProtocol)}, nil
}

// proxyProtocol maps the service's PROXY protocol annotation to forward's setting.
func proxyProtocol(v serviceport.ProxyProtocol) forward.ProxyProtocol {
	switch v {
	case serviceport.ProxyProtocolV1:
		return forward.ProxyProtocolV1
	case serviceport.ProxyProtocolV2:
		return forward.ProxyProtocolV2
	}
	return forward.ProxyProtocolNone
}

// open allocates a proxy port, opens the listener and starts serving it.
func (l *listener) open(alloc *portalloc.Allocator, bind netip.Addr, udpTimeout time.Duration, m TrafficMetrics) error {
	sp := l.sp.Load()
	var metrics forward.Metrics
	if m != nil {
		metrics = m.ForPort(sp.Name, sp.Protocol)
	}
	var failed []int
	defer func() {
		for _, p := range failed {
			alloc.Release(p)
		}
	}()
	attempts := maxOpenAttempts
	if r := alloc.Range(); r.Size > 0 && r.Size < attempts {
		attempts = r.Size
	}
	var lastErr error
	for range attempts {
		port, err := alloc.Allocate()
		if err != nil {
			return fmt.Errorf("open proxy listener for %s: %w (last bind error: %v)", sp, err, lastErr)
		}
		addr := listenAddr(bind, port)
		switch sp.Protocol {
		case v1.ProtocolUDP:
			conn, err := net.ListenUDP(udpNetwork(bind), net.UDPAddrFromAddrPort(addr))
			if err != nil {
				lastErr = err
				failed = append(failed, port)
				continue
			}
			l.proxyPort = conn.LocalAddr().(*net.UDPAddr).Port
			l.udp = &forward.UDPProxy{Conn: conn, Chooser: l, Timeout: udpTimeout, Log: l.log, Metrics: metrics}
			l.served.Add(1)
			go l.serveUDP(l.udp)
		default:
			ln, err := forward.ListenTCP(tcpNetwork(bind), net.TCPAddrFromAddrPort(addr))
			if err != nil {
				lastErr = err
				failed = append(failed, port)
				continue
			}
			l.proxyPort = ln.Addr().(*net.TCPAddr).Port
			l.tcp = &forward.TCPProxy{Listener: ln, Chooser: l, Log: l.log, Metrics: metrics}
			l.served.Add(1)
			go l.serveTCP(l.tcp)
		}
		l.proto = sp.Protocol
		return nil
	}
	return fmt.Errorf("open proxy listener for %s: %d ports tried: %w", sp, attempts, lastErr)
}

func (l *listener) serveTCP(t *forward.TCPProxy) {
	defer l.served.Done()
	if err := t.Serve(); err != nil {
		l.log.Error().Err(err).Msg("TCP proxy stopped")
	}
}

func (l *listener) serveUDP(u *forward.UDPProxy) {
	defer l.served.Done()
	if err := u.Serve(); err != nil {
		l.log.Error().Err(err).Msg("UDP proxy stopped")
	}
}

// endpointsChanged drops UDP sessions to endpoints that left the port.
func (l *listener) endpointsChanged(eps []serviceport.Endpoint) {
	if l.udp == nil {
		return
	}
	keep := make(map[netip.AddrPort]bool, len(eps))
	for _, e := range eps {
		if e.Serving || e.Ready {
			keep[e.Addr] = true
		}
	}
	l.udp.DropSessions(func(ep netip.AddrPort) bool { return keep[ep] })
}

// stopAccepting closes the listening socket; established TCP connections go on.
func (l *listener) stopAccepting() {
	var err error
	switch {
	case l.tcp != nil:
		err = l.tcp.Close()
	case l.udp != nil:
		err = l.udp.Close()
	}
	if err != nil && !errors.Is(err, net.ErrClosed) {
		l.log.Warn().Err(err).Msg("closing proxy listener")
	}
	l.served.Wait()
}

// close stops the listener, cuts its established connections and releases its port.
func (l *listener) close(alloc *portalloc.Allocator) {
	l.stopAccepting()
	if l.tcp != nil {
		ctx, cancel := context.WithCancel(context.Background())
		cancel() // a deleted service port's connections end now
		_ = l.tcp.Shutdown(ctx)
	}
	l.release(alloc)
	if m := l.proxier.opts.Metrics; m != nil {
		sp := l.sp.Load()
		m.Forget(sp.Name, sp.Protocol)
	}
}

// shutdown waits for established TCP connections until ctx is done.
func (l *listener) shutdown(ctx context.Context) error {
	if l.tcp == nil {
		return nil
	}
	return l.tcp.Shutdown(ctx)
}

func (l *listener) release(alloc *portalloc.Allocator) {
	if l.proxyPort != 0 {
		alloc.Release(l.proxyPort)
	}
	l.proxyPort, l.tcp, l.udp = 0, nil, nil
}

func listenAddr(bind netip.Addr, port int) netip.AddrPort {
	if bind.IsUnspecified() {
		return netip.AddrPortFrom(netip.IPv6Unspecified(), uint16(port))
	}
	return netip.AddrPortFrom(bind, uint16(port))
}

// tcpNetwork and udpNetwork: an unspecified bind address listens on both families.
func tcpNetwork(bind netip.Addr) string {
	switch {
	case bind.IsUnspecified():
		return "tcp"
	case bind.Is4():
		return "tcp4"
	}
	return "tcp6"
}

func udpNetwork(bind netip.Addr) string {
	switch {
	case bind.IsUnspecified():
		return "udp"
	case bind.Is4():
		return "udp4"
	}
	return "udp6"
}
