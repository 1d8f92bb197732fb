package userspace

import (
	"fmt"
	"net/netip"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// selfAddrs is what the proxy itself answers on, as of one sync: every portal IP:port (ClusterIP,
// external IP and load-balancer IP with the service port), and the proxy ports and NodePorts,
// which answer on every address of the node. An endpoint there would have the proxy connect to
// itself, each connection opening another until the node runs out of descriptors; such
// endpoints are refused.
//
// Its maps hold the listener whose address each is (named by what add recorded of it, selfSP),
// not its name: a pointer is a sixth of a proxy.Name, at 10,000 ports and more.
type selfAddrs struct {
	portals map[protoAddrPort]*listener
	ports   map[protoPort]portUse // proxy ports and NodePorts on the node's addresses
	node    proxy.NodeAddrs
	// collided is set when two ports have one address (see add).
	collided bool
}

type protoAddrPort struct {
	proto v1.Protocol
	ap    netip.AddrPort
}

type protoPort struct {
	proto v1.Protocol
	port  int
}

// portUse says what a port of the node is to the proxy: formatted only for an error, as every
// sync collects one per service port.
type portUse struct {
	nodePort bool // the NodePort of l; false: its proxy port
	l        *listener
}

func (u portUse) String() string {
	if u.nodePort {
		return "the NodePort of " + u.l.selfSP.Name.String()
	}
	return "the proxy port of " + u.l.selfSP.Name.String()
}

// newSelfAddrs collects the proxy's own addresses from its listeners and the node's addresses,
// in maps sized to what they hold.
func newSelfAddrs(ports map[proxy.Name]*listener, node proxy.NodeAddrs) *selfAddrs {
	nPortals, nPorts := 0, 0
	for _, l := range ports {
		sp := l.choose.sp.Load()
		nPortals += len(sp.ClusterIPs) + len(sp.ExternalIPs) + len(sp.LoadBalancerIPs)
		if l.isOpen() {
			nPorts++
		}
		if sp.NodePort != 0 {
			nPorts++
		}
	}
	s := &selfAddrs{
		portals: make(map[protoAddrPort]*listener, nPortals),
		ports:   make(map[protoPort]portUse, nPorts),
		node:    node,
	}
	for _, l := range ports {
		s.add(l)
	}
	return s
}

// add records l's addresses as they are now, and on l what it recorded, for drop. An address
// that another port has too sets collided: drop could then forget it while the other port still
// has it, so the caller rebuilds instead of updating.
func (s *selfAddrs) add(l *listener) {
	sp := l.choose.sp.Load()
	port := 0
	if l.isOpen() {
		port = l.proxyPort
	}
	l.selfSP, l.selfPort = sp, port
	eachSelfAddr(l, sp, port, func(k protoAddrPort) {
		if o, dup := s.portals[k]; dup && o != l {
			s.collided = true
		}
		s.portals[k] = l
	}, func(k protoPort, u portUse) {
		if o, dup := s.ports[k]; dup && o.l != l {
			s.collided = true
		}
		s.ports[k] = u
	})
}

// drop forgets the addresses add recorded for l.
func (s *selfAddrs) drop(l *listener) {
	sp := l.selfSP
	if sp == nil {
		return
	}
	eachSelfAddr(l, sp, l.selfPort, func(k protoAddrPort) {
		if s.portals[k] == l {
			delete(s.portals, k)
		}
	}, func(k protoPort, _ portUse) {
		if s.ports[k].l == l {
			delete(s.ports, k)
		}
	})
	l.selfSP, l.selfPort = nil, 0
}

// eachSelfAddr calls portal with each portal address of sp (l's port), and port with its proxy
// port (0: none) and NodePort.
func eachSelfAddr(l *listener, sp *proxy.ServicePort, proxyPort int, portal func(protoAddrPort), port func(protoPort, portUse)) {
	for _, ips := range [][]netip.Addr{sp.ClusterIPs, sp.ExternalIPs, sp.LoadBalancerIPs} {
		for _, ip := range ips {
			portal(protoAddrPort{sp.Protocol, netip.AddrPortFrom(ip.Unmap(), uint16(sp.Port))})
		}
	}
	if proxyPort != 0 {
		port(protoPort{sp.Protocol, proxyPort}, portUse{l: l})
	}
	if sp.NodePort != 0 {
		port(protoPort{sp.Protocol, sp.NodePort}, portUse{nodePort: true, l: l})
	}
}

// check returns why ep, an endpoint of a port of protocol proto, is the proxy itself, or nil.
func (s *selfAddrs) check(proto v1.Protocol, ep netip.AddrPort) error {
	ap := netip.AddrPortFrom(ep.Addr().Unmap(), ep.Port())
	if owner, ok := s.portals[protoAddrPort{proto, ap}]; ok {
		return fmt.Errorf("endpoint %s is a service address of %s, served by this proxy", ep, owner.selfSP.Name)
	}
	a := ap.Addr()
	if a.IsLoopback() || a.IsUnspecified() || s.node.Contains(a) {
		if what, ok := s.ports[protoPort{proto, int(ep.Port())}]; ok {
			return fmt.Errorf("endpoint %s is this node's address with %s, served by this proxy", ep, what)
		}
	}
	return nil
}

// filter returns the endpoints of sp that are not the proxy itself, and an error naming the
// service port and every endpoint it left out. It returns eps itself when nothing is left out.
func (s *selfAddrs) filter(sp *proxy.ServicePort, eps []proxy.Endpoint) ([]proxy.Endpoint, error) {
	var errs []error
	keep := eps
	for i, e := range eps {
		err := s.check(sp.Protocol, e.Addr)
		if err == nil {
			if len(errs) > 0 {
				keep = append(keep, e)
			}
			continue
		}
		if len(errs) == 0 {
			keep = append([]proxy.Endpoint(nil), eps[:i]...)
		}
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		return eps, nil
	}
	return keep, fmt.Errorf("service port %s: %d endpoint(s) refused: %v", sp, len(errs), errs)
}
