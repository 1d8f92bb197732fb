// Command coredns is the local cluster's DNS server (hack/cluster.sh): CoreDNS with only the
// plugins a cluster's DNS needs, so it builds in a fraction of the full binary's time. The
// Corefile (hack/cluster/dns/coredns.yaml) uses them; the plugin order is CoreDNS's own
// (dnsserver.Directives), whatever the order of the imports here.
package main

import (
	"github.com/coredns/coredns/coremain"

	// The plugins, each registering itself.
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func main() {
	coremain.Run()
}
