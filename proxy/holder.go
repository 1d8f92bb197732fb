package proxy

import (
	"io"
	"net"
	"net/netip"
	"slices"
	"sort"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"
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

// holder keeps real sockets open on every NodePort and on every portal IP:port that is an address
// of this node, as the userspace mode did: no other process can take those ports, and `ss -l`
// shows who owns them. The portal rules redirect traffic before it reaches these sockets.
// It is used only under Proxier.mu.
type holder struct {
	log        zerolog.Logger
	localAddrs func() ([]netip.Addr, error)
	held       map[holdKey]io.Closer
	// failed remembers ports that could not be held, so each is reported once.
	failed map[holdKey]bool
}

func newHolder(log zerolog.Logger, localAddrs func() ([]netip.Addr, error)) *holder {
	if localAddrs == nil {
		localAddrs = interfaceAddrs
	}
	return &holder{log: log, localAddrs: localAddrs, held: map[holdKey]io.Closer{}, failed: map[holdKey]bool{}}
}

// reconcile opens the sockets the ports need and closes the ones no longer needed.
func (h *holder) reconcile(ports []PortState) {
	local, err := h.localAddrs()
	if err != nil {
		h.log.Warn().Err(err).Msg("listing node addresses; local portal IPs are not held this sync")
	}
	want := map[holdKey]bool{}
	for _, st := range ports {
		sp := st.ServicePort
		if sp.NodePort != 0 {
			want[holdKey{proto: sp.Protocol, addr: netip.IPv6Unspecified(), port: sp.NodePort}] = true
		}
		for _, ip := range slices.Concat(sp.ExternalIPs, sp.LoadBalancerIPs, sp.ClusterIPs) {
			if slices.Contains(local, ip) {
				want[holdKey{proto: sp.Protocol, addr: ip, port: sp.Port}] = true
			}
		}
	}
	for k, c := range h.held {
		if !want[k] {
			_ = c.Close()
			delete(h.held, k)
		}
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

// heldKeys returns the held ports (for tests).
func (h *holder) heldKeys() []string {
	out := make([]string, 0, len(h.held))
	for k := range h.held {
		out = append(out, k.String())
	}
	sort.Strings(out)
	return out
}

func (h *holder) closeAll() {
	for k, c := range h.held {
		_ = c.Close()
		delete(h.held, k)
	}
}

func hold(k holdKey) (io.Closer, error) {
	ap := netip.AddrPortFrom(k.addr, uint16(k.port))
	network := "tcp"
	if k.proto == v1.ProtocolUDP {
		network = "udp"
	}
	if !k.addr.IsUnspecified() {
		if k.addr.Is4() {
			network += "4"
		} else {
			network += "6"
		}
	}
	if k.proto == v1.ProtocolUDP {
		return net.ListenUDP(network, net.UDPAddrFromAddrPort(ap))
	}
	return net.ListenTCP(network, net.TCPAddrFromAddrPort(ap))
}

func interfaceAddrs() ([]netip.Addr, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	out := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil {
			out = append(out, p.Addr().Unmap())
		}
	}
	return out, nil
}
