//go:build linux

package e2e

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// TestHandoverSIGTERMDuringExchange: the running proxy gets SIGTERM while a successor is taking
// over (its freeze waits for clients still dialling an endpoint that drops SYNs). The exchange
// finishes first and decides: the proxy hands everything over and exits without removing a
// portal; the successor serves on, with the same rules and the UDP client's endpoint.
func TestHandoverSIGTERMDuringExchange(t *testing.T) {
	n := netns.NewNetwork(t, "e2g")
	node := n.AddNode(t, "gn")
	hole := n.AddPod(t, node, "ghole")
	harness.StartEcho(t, hole.NS, "hole", echoPort)
	// The endpoint answers UDP, and drops every TCP SYN: a dial to it stays in progress.
	hole.Run(t, "iptables", "-A", "INPUT", "-p", "tcp", "--syn", "--dport", strconv.Itoa(echoPort), "-j", "DROP")
	clientPod := n.AddPod(t, node, "gcli")
	dir := t.TempDir()
	writeManifests(t, dir, hole)
	const webTCP, webUDP = "10.96.7.7:80", "10.96.7.7:53"

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg := harness.ProxyConfig{NodeName: nodeName, Manifests: dir,
		Args: []string{"--iptables-sync-period=" + syncPeriod.String(), "--iptables-min-sync-period=100ms"},
		Ready: func(ctx context.Context) error {
			_, err := harness.Ask(ctx, clientPod.NS, "udp", webUDP)
			return err
		}}
	first := harness.StartProxy(t, node.NS, cfg)
	rulesBefore := harness.RulesFor(harness.IPTablesSave(t, node.NS), harness.Namespace, "web")
	if len(rulesBefore) == 0 {
		t.Fatal("no rules of web: the case proves nothing")
	}
	udp := startUDPClient(ctx, t, clientPod.NS, webUDP)
	udpBackend := udp.ask(t, "before")

	// Clients connecting all along: at any moment one is dialling the endpoint.
	dialCtx, stopDialling := context.WithCancel(ctx)
	var dialling sync.WaitGroup
	dialling.Go(func() {
		for dialCtx.Err() == nil {
			c, err := clientPod.NS.DialContext(dialCtx, "tcp", webTCP)
			if err == nil {
				_, _ = c.Write([]byte("hello\n"))
				go func() { <-dialCtx.Done(); c.Close() }()
			}
			select {
			case <-dialCtx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	})
	defer func() { stopDialling(); dialling.Wait() }()
	time.Sleep(300 * time.Millisecond)

	second := node.NS.Start(t, harness.ProxyArgs(t, cfg)...)
	second.DumpGoroutinesOnFailure()
	for !strings.Contains(first.Log(), "a successor asks to take over: freezing") {
		select {
		case <-ctx.Done():
			t.Fatalf("the first proxy was never asked to hand over; its log:\n%s\nthe second's:\n%s", first.Tail(30), second.Tail(30))
		case <-second.Done():
			t.Fatalf("the second proxy exited (%v):\n%s", second.Err(), second.Tail(30))
		case <-time.After(5 * time.Millisecond):
		}
	}
	if err := syscall.Kill(first.Pid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-first.Done():
	case <-ctx.Done():
		t.Fatalf("the first proxy did not exit after SIGTERM; its log:\n%s", first.Tail(30))
	}
	if err := first.Err(); err != nil {
		t.Errorf("the first proxy exited with %v, want 0", err)
	}
	log := first.Log()
	if !strings.Contains(log, "handed over to the successor") || strings.Contains(log, "removing portals") {
		t.Errorf("the first proxy, signalled during the exchange, did not hand over or removed portals; its log:\n%s", first.Tail(40))
	}
	select {
	case <-second.Done():
		t.Fatalf("the second proxy exited (%v):\n%s", second.Err(), second.Tail(30))
	default:
	}
	// The first proxy exits once the second said ready; the second logs its adoption after.
	for !strings.Contains(second.Log(), "adopted what the predecessor handed over") {
		select {
		case <-ctx.Done():
			t.Fatalf("the second proxy did not adopt anything:\n%s", second.Tail(30))
		case <-second.Done():
			t.Fatalf("the second proxy exited (%v):\n%s", second.Err(), second.Tail(30))
		case <-time.After(5 * time.Millisecond):
		}
	}
	if got := udp.ask(t, "after"); got != udpBackend {
		t.Errorf("UDP answered by %s after the hand-over, %s before", got, udpBackend)
	}
	rulesAfter := harness.RulesFor(harness.IPTablesSave(t, node.NS), harness.Namespace, "web")
	if strings.Join(rulesAfter, "\n") != strings.Join(rulesBefore, "\n") {
		t.Errorf("web's rules changed across the hand-over:\nbefore:\n%s\nafter:\n%s", strings.Join(rulesBefore, "\n"), strings.Join(rulesAfter, "\n"))
	}
}
