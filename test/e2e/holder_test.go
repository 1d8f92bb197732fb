//go:build linux

package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// A crash refuses nothing: with a holder (kube-userspace-proxy hold) keeping duplicates of its
// listening sockets, a proxy killed with SIGKILL under a stream of new connections leaves them
// waiting in the kernel's accept queue (a UDP datagram in the socket's receive queue), and the
// next process, started a second later as a kubelet would, serves every one of them.

// timedAnswer is one request of a load: when it began, how long it took, and how it ended.
type timedAnswer struct {
	network string
	began   time.Time
	took    time.Duration
	err     error
}

// TestCrashRefusesNothing SIGKILLs a proxy that has a holder, under a new TCP connection
// every 10 ms (ClusterIP and NodePort) and a UDP request every 50 ms, each with a 10 s
// timeout; a second process starts 1 s after the kill. Every request must be answered, those
// made while no proxy ran included, except a TCP connection the killed process had accepted
// (reset or closed with it: established streams die with their process).
func TestCrashRefusesNothing(t *testing.T) {
	n := netns.NewNetwork(t, "e2k")
	node := n.AddNode(t, "kn")
	pod := n.AddPod(t, node, "k1")
	harness.StartEcho(t, pod.NS, "p1", echoPort)
	clientPod := n.AddPod(t, node, "kcli")
	dir := t.TempDir()
	writeManifests(t, dir, pod)
	webTCP, webUDP := "10.96.7.7:80", "10.96.7.7:53"
	nodePort := netip.AddrPortFrom(node.IP, 30080).String()

	sock := filepath.Join(t.TempDir(), "holder", "holder.sock")
	holder := node.NS.Start(t, harness.ProxyBinary(t), "hold", "--socket="+sock, "--log-level=debug")
	cfg := harness.ProxyConfig{
		NodeName:  nodeName,
		Manifests: dir,
		Args:      []string{"--iptables-sync-period=" + syncPeriod.String(), "--iptables-min-sync-period=100ms", "--holder-socket=" + sock},
		Ready: func(ctx context.Context) error {
			_, err := harness.Ask(ctx, clientPod.NS, "tcp", webTCP)
			return err
		},
		ReadyTimeout: 20 * time.Second,
	}
	first := harness.StartProxy(t, node.NS, cfg)
	harness.WaitFor(t, 20*time.Second, func() error {
		if !strings.Contains(holder.Log(), "sockets=3") {
			return fmt.Errorf("the holder does not keep the 3 listening sockets yet; its log:\n%s", holder.Tail(10))
		}
		return nil
	})

	var (
		mu      sync.Mutex
		answers []timedAnswer
		wg      sync.WaitGroup
	)
	stop := make(chan struct{})
	ask := func(network, addr string) {
		defer wg.Done()
		began := time.Now()
		_, err := harness.AskTimeout(context.Background(), clientPod.NS, network, addr, 10*time.Second)
		mu.Lock()
		answers = append(answers, timedAnswer{network: network + " " + addr, began: began, took: time.Since(began), err: err})
		mu.Unlock()
	}
	var loadWG sync.WaitGroup
	loadWG.Go(func() {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			addr := webTCP
			if i%2 == 1 {
				addr = nodePort
			}
			wg.Add(1)
			go ask("tcp", addr)
			if i%5 == 0 {
				wg.Add(1)
				go ask("udp", webUDP)
			}
		}
	})
	time.Sleep(500 * time.Millisecond)

	killed := time.Now()
	first.Stop() // SIGKILL, and reaped
	reaped := time.Now()
	time.Sleep(time.Second)
	restarted := time.Now()
	second := node.NS.Start(t, harness.ProxyArgs(t, cfg)...)
	waitSynced(t, second)
	time.Sleep(time.Second)
	close(stop)
	loadWG.Wait()
	wg.Wait()

	var failed []string
	during, lost, served := 0, 0, time.Time{}
	var waits []time.Duration
	for _, a := range answers {
		if k := harness.KindOf(a.err); (k == harness.Reset || k == harness.Closed) && strings.HasPrefix(a.network, "tcp") &&
			a.began.Before(reaped) && a.began.Add(a.took).After(killed) {
			lost++ // accepted by the killed process: lost with it
			continue
		}
		if a.err != nil {
			failed = append(failed, fmt.Sprintf("%s at +%v: %v", a.network, a.began.Sub(killed).Round(time.Millisecond), a.err))
			continue
		}
		if a.began.After(killed) && a.began.Before(restarted) {
			during++
			waits = append(waits, a.took)
			if end := a.began.Add(a.took); served.IsZero() || end.Before(served) {
				served = end
			}
		}
	}
	sort.Slice(waits, func(i, j int) bool { return waits[i] < waits[j] })
	t.Logf("%d requests, %d lost with the killed process, %d failed; %d made while no proxy ran, all answered, the first %v after the new process started; their wait %v to %v",
		len(answers), lost, len(failed), during, served.Sub(restarted).Round(time.Millisecond), firstOr(waits, 0).Round(time.Millisecond), lastOr(waits).Round(time.Millisecond))
	if len(failed) > 0 {
		t.Errorf("%d of %d requests failed across the crash; first: %v\nthe new proxy's log:\n%s", len(failed), len(answers), failed[:min(len(failed), 5)], untilSynced(second.Log()))
	}
	if during < 50 {
		t.Errorf("only %d requests made while no proxy ran: the test did not exercise the crash", during)
	}
	if !strings.Contains(second.Log(), "took the listening sockets the holder kept") {
		t.Errorf("the new proxy did not take the holder's sockets; its log:\n%s", untilSynced(second.Log()))
	}
}

func firstOr(d []time.Duration, def time.Duration) time.Duration {
	if len(d) == 0 {
		return def
	}
	return d[0]
}

func lastOr(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	return d[len(d)-1]
}
