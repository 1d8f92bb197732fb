package logscope

import (
	"net/netip"
	"sync/atomic"

	"github.com/rs/zerolog"
)

// TransparentFallback logs that a transparent socket could not be set up and a plain one is
// used instead: at warning level the first time for a proxy (warned), at debug level after.
func TransparentFallback(log *zerolog.Logger, scope Scope, warned *atomic.Bool, err error, client, ep netip.AddrPort) {
	e := log.Debug()
	if warned.CompareAndSwap(false, true) {
		e = log.Warn()
	}
	Event(scope, e).Err(err).Stringer("client", client).Stringer("endpoint", ep).
		Msg("cannot connect from the client's address (needs CAP_NET_ADMIN); connecting from the node's instead (logged once at warning level)")
}
