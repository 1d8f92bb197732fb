package userspace

import (
	"io"
	"net"
	"net/netip"
	"os"
	"sort"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// holdKey names one held port: protocol, address (unspecified for every address) and port.
type holdKey struct {
	proto v1.Protocol
	addr  netip.Addr
	port  int
}

func (k holdKey) String() string {
	return string(k.proto) + " " + netip.AddrPortFrom(k.addr, uint16(k.port)).String()
}

// holder keeps real sockets on every NodePort and on every portal IP:port that is an address of
// this node, as the userspace mode did: no other process can take those ports (`ss -tuap`
// shows who owns them). The portal rules redirect traffic before it reaches these sockets; TCP
// ones are bound without listening, so a connection that was not redirected is refused rather
// than accepted and left hanging.
// It is used only under Proxier.mu.
type holder struct {
	log  zerolog.Logger
	held map[holdKey]io.Closer
	// inherited are sockets a predecessor handed over, until reconcile keeps or closes them.
	inherited map[holdKey]*os.File
	// failed remembers ports that could not be held, so each is reported once.
	failed map[holdKey]bool
}

func newHolder(log zerolog.Logger) *holder {
	return &holder{log: log, held: map[holdKey]io.Closer{}, inherited: map[holdKey]*os.File{}, failed: map[holdKey]bool{}}
}

// reconcile opens the sockets the ports need and closes the ones no longer needed; node is the
// node's addresses as of this sync.
func (h *holder) reconcile(ports []proxy.PortState, node proxy.NodeAddrs) {
	want := map[holdKey]bool{}
	for _, st := range ports {
		sp := st.ServicePort
		if sp.NodePort != 0 {
			want[holdKey{proto: sp.Protocol, addr: netip.IPv6Unspecified(), port: sp.NodePort}] = true
		}
		for _, ips := range [...][]netip.Addr{sp.ExternalIPs, sp.LoadBalancerIPs, sp.ClusterIPs} {
			for _, ip := range ips {
				if node.Contains(ip) {
					want[holdKey{proto: sp.Protocol, addr: ip, port: sp.Port}] = true
				}
			}
		}
	}
	for k, c := range h.held {
		if !want[k] {
			_ = c.Close()
			delete(h.held, k)
		}
	}
	for k, f := range h.inherited {
		if want[k] && h.held[k] == nil {
			h.held[k] = f
		} else {
			_ = f.Close()
		}
		delete(h.inherited, k)
	}
	for k := range h.failed {
		if !want[k] {
			delete(h.failed, k)
		}
	}
	keys := make([]holdKey, 0, len(want))
	for k := range want {
		if _, ok := h.held[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].String() < keys[j].String() })
	for _, k := range keys {
		c, err := hold(k)
		if err != nil {
			if !h.failed[k] {
				h.log.Warn().Err(err).Str("port", k.String()).Msg("cannot hold port; another process may take it")
				h.failed[k] = true
			}
			continue
		}
		delete(h.failed, k)
		h.held[k] = c
	}
}

func (h *holder) closeAll() {
	for k, c := range h.held {
		_ = c.Close()
		delete(h.held, k)
	}
	for k, f := range h.inherited {
		_ = f.Close()
		delete(h.inherited, k)
	}
}

func hold(k holdKey) (io.Closer, error) {
	ap := netip.AddrPortFrom(k.addr, uint16(k.port))
	if k.proto != v1.ProtocolUDP {
		return bindTCP(ap)
	}
	network := "udp"
	if !k.addr.IsUnspecified() {
		if k.addr.Is4() {
			network += "4"
		} else {
			network += "6"
		}
	}
	return net.ListenUDP(network, net.UDPAddrFromAddrPort(ap))
}
