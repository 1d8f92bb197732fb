//go:build linux

package e2e

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// After a SIGKILL, the restarted proxy reopens its listeners on the proxy ports the
// surviving rules name, so traffic resumes as soon as they are open.

// proxyPortRule matches a rule of ours that sends a service port's traffic to its proxy port.
var proxyPortRule = regexp.MustCompile(`^-A KUBE-\S+ .*-p (tcp|udp) .*--comment "?([^" ]+)"? .*-j (?:REDIRECT --to-ports|DNAT --to-destination \S+:)(\d+)$`)

// proxyPortsIn returns, per "service port name/protocol", the proxy port the REDIRECT and DNAT
// rules of an iptables-save listing name; it fails the test when one names two.
func proxyPortsIn(t *testing.T, listing string) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, line := range strings.Split(listing, "\n") {
		m := proxyPortRule.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		key := m[2] + "/" + m[1]
		port, _ := strconv.Atoi(m[3])
		if was, ok := out[key]; ok && was != port {
			t.Fatalf("rules name proxy ports %d and %d for %s", was, port, key)
		}
		out[key] = port
	}
	return out
}

// firstAnswer asks addr over TCP from ns until a backend answers and returns how long after
// start that was; it fails the test after timeout.
func firstAnswer(t *testing.T, ns *netns.NS, addr string, start time.Time, timeout time.Duration) time.Duration {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var last error
	for ctx.Err() == nil {
		if _, last = harness.AskTimeout(ctx, ns, "tcp", addr, 250*time.Millisecond); last == nil {
			return time.Since(start)
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("no answer from %s within %v of the proxy's start: %v", addr, timeout, last)
	return 0
}

// untilSynced returns a proxy's log up to its first completed sync.
func untilSynced(log string) string {
	if i := strings.Index(log, " synced"); i >= 0 {
		if j := strings.IndexByte(log[i:], '\n'); j >= 0 {
			return log[:i+j]
		}
	}
	return log
}

// waitSynced waits until the proxy's debug log reports a completed sync.
func waitSynced(t *testing.T, p *netns.Process) {
	t.Helper()
	harness.WaitFor(t, 20*time.Second, func() error {
		select {
		case <-p.Done():
			return fmt.Errorf("the proxy exited: %v", p.Err())
		default:
		}
		if !strings.Contains(p.Log(), " synced") {
			return errors.New("no completed sync in the log yet")
		}
		return nil
	})
}

// TestRestartReusesProxyPorts kills the proxy with SIGKILL and starts it again over the rules it
// left: every service port must get its old proxy port back and answer; the time from the
// second process's start to the first answered connection is logged, next to the same figure
// for a start without rules (after --cleanup).
func TestRestartReusesProxyPorts(t *testing.T) {
	n := netns.NewNetwork(t, "e2r")
	node := n.AddNode(t, "rn")
	pod := n.AddPod(t, node, "r1")
	harness.StartEcho(t, pod.NS, "p1", echoPort)
	clientPod := n.AddPod(t, node, "rcli")
	dir := t.TempDir()
	writeManifests(t, dir, pod)

	webTCP, webUDP := "10.96.7.7:80", "10.96.7.7:53"
	nodePort := netip.AddrPortFrom(node.IP, 30080).String()
	cfg := harness.ProxyConfig{
		NodeName:  nodeName,
		Manifests: dir,
		Args:      []string{"--iptables-sync-period=" + syncPeriod.String(), "--iptables-min-sync-period=100ms"},
		Ready: func(ctx context.Context) error {
			_, err := harness.Ask(ctx, clientPod.NS, "tcp", webTCP)
			return err
		},
		ReadyTimeout: 20 * time.Second,
	}
	first := harness.StartProxy(t, node.NS, cfg)
	t.Logf("first start (fresh namespace): answered %v after the process started", first.Ready.Sub(first.Started).Round(time.Millisecond))
	waitSynced(t, first.Process)
	before := proxyPortsIn(t, harness.IPTablesSave(t, node.NS))
	if len(before) != 3 {
		t.Fatalf("proxy ports in the rules: %v; want the 3 service ports'", before)
	}

	first.Stop() // SIGKILL: the rules stay behind
	if after := proxyPortsIn(t, harness.IPTablesSave(t, node.NS)); !maps.Equal(after, before) {
		t.Fatalf("the rules changed when the proxy was killed: %v, then %v", before, after)
	}
	answerAll := func(t *testing.T) {
		t.Helper()
		for _, c := range []struct{ network, addr string }{{"tcp", webTCP}, {"udp", webUDP}, {"tcp", nodePort}} {
			if _, err := harness.Ask(context.Background(), clientPod.NS, c.network, c.addr); err != nil {
				t.Errorf("%s %s: %v", c.network, c.addr, err)
			}
		}
	}

	t.Run("restart over the rules", func(t *testing.T) {
		start := time.Now()
		second := node.NS.Start(t, harness.ProxyArgs(t, cfg)...)
		took := firstAnswer(t, clientPod.NS, webTCP, start, 20*time.Second)
		t.Logf("restart after SIGKILL: first answered connection %v after the process started", took.Round(time.Millisecond))
		waitSynced(t, second)
		t.Logf("the restarted proxy's log up to its first sync (process started %s):\n%s", start.UTC().Format("15:04:05.000"), untilSynced(second.Log()))
		if got := proxyPortsIn(t, harness.IPTablesSave(t, node.NS)); !maps.Equal(got, before) {
			t.Errorf("proxy ports after the restart's first sync: %v, want the earlier run's %v", got, before)
		}
		answerAll(t)
		second.Stop()
	})

	t.Run("start after --cleanup", func(t *testing.T) {
		harness.RunCleanup(t, node.NS)
		if left := proxyPortsIn(t, harness.IPTablesSave(t, node.NS)); len(left) != 0 {
			t.Fatalf("rules left after --cleanup: %v", left)
		}
		start := time.Now()
		third := node.NS.Start(t, harness.ProxyArgs(t, cfg)...)
		took := firstAnswer(t, clientPod.NS, webTCP, start, 20*time.Second)
		t.Logf("start without rules (after --cleanup): first answered connection %v after the process started", took.Round(time.Millisecond))
		waitSynced(t, third)
		answerAll(t)
	})
}
