package portal

import (
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// Render returns the iptables-restore input (the lines between "*table" and "COMMIT") that sets
// our nat and filter chains to exactly what portals need. Output is deterministic: portals are
// ordered by Comment, Protocol and ports, and each portal's addresses by value. Portals that fail
// Validate, and addresses not in cfg.Family, are left out. Render does no I/O.
func Render(cfg Config, host Host, portals []Portal) (nat, filter []byte) {
	return render(cfg, host, renderOrder(portals), nil)
}

// toPortals converts the proxier's port states into one family's portals: a service port has
// portals in a family when it has a ClusterIP of that family. In a family it has no ClusterIP
// of, a port whose listener is open still gets a portal with no address and no NodePort: it
// captures nothing but guards the proxy port (KUBE-PORTALS-PROXY-PORTS), because a listener on
// the unspecified address accepts both families.
func toPortals(fam iptables.Family, ports []proxy.PortState) []Portal {
	var c portalCache
	return c.toPortals(fam, ports)
}
