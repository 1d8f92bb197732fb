package portal

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables/netnstest"
)

// scalePortals returns n service ports of a realistic mix: every one has a ClusterIP, every third
// a NodePort, every tenth a load-balancer IP, every twentieth an externalIP, every 25th has no
// endpoints (reject).
func scalePortals(n int) []Portal {
	ps := make([]Portal, n)
	for i := range ps {
		p := Portal{
			Comment:   fmt.Sprintf("ns%d/svc%d:http", i%50, i),
			Protocol:  "tcp",
			Port:      80,
			ClusterIP: netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)}),
			ProxyPort: 32768 + i,
		}
		if i%2 == 1 {
			p.Protocol = "udp"
		}
		if i%3 == 0 {
			p.NodePort = 30000 + i%2768
		}
		if i%10 == 0 {
			p.LoadBalancerIPs = []netip.Addr{netip.AddrFrom4([4]byte{203, 0, byte(i >> 8), byte(i)})}
		}
		if i%20 == 0 {
			p.ExternalIPs = []netip.Addr{netip.AddrFrom4([4]byte{192, 0, byte(i >> 8), byte(i)})}
		}
		if i%25 == 0 {
			p.Internal, p.External = Reject, Reject
		}
		ps[i] = p
	}
	return ps
}

func BenchmarkRender(b *testing.B) {
	for _, n := range []int{1000, 5000} {
		ps := scalePortals(n)
		b.Run(fmt.Sprintf("ports=%d", n), func(b *testing.B) {
			var size int
			for b.Loop() {
				nat, filter := Render(v4Config(), Host{}, ps)
				size = len(nat) + len(filter)
			}
			b.ReportMetric(float64(size), "bytes")
		})
	}
}

// BenchmarkSyncInNamespace measures a whole Sync (render, one iptables-restore per table, the
// jump checks) against a real kernel, for a first sync and for a sync that changes every proxy
// port, with 1,000 and 5,000 service ports, on both backends.
func BenchmarkSyncInNamespace(b *testing.B) {
	for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		for _, n := range []int{1000, 5000} {
			b.Run(fmt.Sprintf("%s/ports=%d", mode, n), func(b *testing.B) {
				ns := netnstest.New(b)
				ps := scalePortals(n)
				ns.Do(b, func() {
					r, err := iptables.New(iptables.Options{Family: iptables.IPv4, Mode: mode})
					if err != nil {
						b.Fatal(err)
					}
					m, err := NewManager(Options{Config: v4Config(), Runner: r})
					if err != nil {
						b.Fatal(err)
					}
					start := time.Now()
					if err := m.Sync(ps); err != nil {
						b.Fatal(err)
					}
					first := time.Since(start)
					i := 0
					for b.Loop() {
						i++
						for j := range ps {
							ps[j].ProxyPort = 32768 + (j+i)%20000
						}
						if err := m.Sync(ps); err != nil {
							b.Fatal(err)
						}
					}
					b.ReportMetric(float64(first.Milliseconds()), "first-sync-ms")
					if err := m.Cleanup(); err != nil {
						b.Fatal(err)
					}
				})
			})
		}
	}
}
