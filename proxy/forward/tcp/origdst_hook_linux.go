package tcp

import (
	"net/netip"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
)

// testHookOriginalDst, if set, is called each time fdOriginalDst asks the kernel. Tests that
// set it do so before their proxy starts and clear it after it ends.
var testHookOriginalDst func()

// fdOriginalDst is sys.OriginalDst, after testHookOriginalDst.
func fdOriginalDst(fd int) netip.AddrPort {
	if h := testHookOriginalDst; h != nil {
		h()
	}
	return sys.OriginalDst(fd)
}
