// Command kube-userspace-proxy is a Kubernetes service proxy in the manner of kube-proxy's
// userspace mode: a listener per service port, iptables portals that redirect service traffic to
// it, and a splice to an endpoint per connection or flow. Run it with --help for its flags.
package main

import (
	"os"
	"runtime"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/app"
)

func main() {
	// No allocation sampling unless profiles are served (app.Run turns it back on then): the
	// sampled stacks' tables grow to ~1.5 MiB in a proxy with 10,000 service ports.
	runtime.MemProfileRate = 0
	os.Exit(app.Main(os.Args[1:], os.Stdout, os.Stderr))
}
