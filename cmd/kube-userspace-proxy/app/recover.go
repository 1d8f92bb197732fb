package app

import (
	"context"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/userspace"
)

// survivingPorts returns the proxy ports that the rules of an earlier run (killed, crashed)
// name, for the proxier to reopen its listeners on (userspace.Options.PreferredPorts), so the
// surviving rules serve again as soon as the listeners are open. When the rules cannot be read
// it logs and goes on with what it could read: the ports it misses are allocated anew.
func survivingPorts(ctx context.Context, portals *portal.Set, log zerolog.Logger) userspace.PreferredPorts {
	ports, err := portals.SurvivingProxyPorts(ctx)
	if err != nil {
		log.Warn().Err(err).Msg("cannot read the proxy ports of the earlier run's rules; their service ports get new ones")
	}
	return ports
}
