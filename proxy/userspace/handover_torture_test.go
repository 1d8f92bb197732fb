//go:build linux

package userspace

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
)

// The hand-over torture test: hand-overs to a fresh proxier through the hand-over socket, failed
// hand-overs that thaw, and freezes that fail halfway (some listeners frozen, others still
// serving, then thawed), at random (seeded) moments — two in three of those that follow a thaw
// or an adoption come at once, while the loops are still taking the connections back — while
// clients keep connections in every state on the event-loop data path: dialling an endpoint
// that drops SYNs (two service ports), dials refused, idle, mid-bulk transfer (pausing at
// random), half closed at the end of each transfer, with a PROXY protocol header, and UDP
// sessions mid exchange. Transparent dialling needs a node's network namespace and is left to
// the end-to-end tests. Every TCP stream is checked end to end against the bytes its client
// generated from a seed of its own (a byte of another connection fails it), every PROXY header
// must name its own client's port, every UDP reply its own client and sequence number.
//
// Knobs: KUP_TORTURE_RUNS (runs one after another, each with fresh proxiers, clients and
// endpoints and a seed of its own: the first seed, then the next ones; default 4),
// KUP_TORTURE_DURATION (of each run; default 6s), KUP_TORTURE_SEED (the first run's; default: the
// time), and KUP_TORTURE_SCALE (client goroutines per kind, multiplied; default 1). A failed
// run names its seed: KUP_TORTURE_SEED=<it> KUP_TORTURE_RUNS=1 runs it again.

// tortureKnobs reads the environment's knobs.
func tortureKnobs(t *testing.T) (runs int, d time.Duration, seed uint64, scale int) {
	t.Helper()
	runs, d, seed, scale = 4, 6*time.Second, uint64(time.Now().UnixNano()), 1
	if v := os.Getenv("KUP_TORTURE_RUNS"); v != "" {
		var err error
		if runs, err = strconv.Atoi(v); err != nil || runs < 1 {
			t.Fatalf("KUP_TORTURE_RUNS: %q, want a number of runs from 1", v)
		}
	}
	if v := os.Getenv("KUP_TORTURE_DURATION"); v != "" {
		var err error
		if d, err = time.ParseDuration(v); err != nil {
			t.Fatalf("KUP_TORTURE_DURATION: %v", err)
		}
	}
	if v := os.Getenv("KUP_TORTURE_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("KUP_TORTURE_SEED: %v", err)
		}
	}
	if v := os.Getenv("KUP_TORTURE_SCALE"); v != "" {
		var err error
		if scale, err = strconv.Atoi(v); err != nil || scale < 1 {
			t.Fatalf("KUP_TORTURE_SCALE: %q", v)
		}
	}
	return runs, d, seed, scale
}

// torture is one run's shared state.
type torture struct {
	t    *testing.T
	seed uint64
	stop chan struct{}

	conns, bytes, udpExchanges, holeConns, refusedConns atomic.Int64

	mu       sync.Mutex
	failures []string
}

func (r *torture) fail(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.failures) < 50 {
		r.failures = append(r.failures, fmt.Sprintf(format, args...))
	}
}

func (r *torture) stopping() bool {
	select {
	case <-r.stop:
		return true
	default:
		return false
	}
}

// stream returns the bytes of a connection's stream: the same for the same (kind, id, n).
func (r *torture) stream(kind, id, n int) *rand.ChaCha8 {
	var s [32]byte
	binary.LittleEndian.PutUint64(s[0:], r.seed)
	binary.LittleEndian.PutUint64(s[8:], uint64(kind))
	binary.LittleEndian.PutUint64(s[16:], uint64(id))
	binary.LittleEndian.PutUint64(s[24:], uint64(n))
	return rand.NewChaCha8(s)
}

// tortureEcho is a TCP (and UDP) echo endpoint: a TCP connection's bytes come back until its
// EOF, which comes back too (half close). With pp, each connection starts with a PROXY v1
// header, sent back first as it came.
func tortureEcho(t *testing.T, name string, pp bool) *backend {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	pc, err := net.ListenPacket("udp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		ln.Close()
		t.Fatal(err)
	}
	b := &backend{name: name, addr: netipLoopback(port), ln: ln, pc: pc}
	b.wg.Add(2)
	go func() {
		defer b.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			b.wg.Go(func() {
				defer c.Close()
				var src io.Reader = c
				if pp {
					br := bufio.NewReader(c)
					hdr, err := br.ReadString('\n')
					if err != nil || !strings.HasPrefix(hdr, "PROXY TCP4 ") {
						_ = c.(*net.TCPConn).SetLinger(0)
						return
					}
					if _, err := io.WriteString(c, hdr); err != nil {
						return
					}
					src = br
				}
				if _, err := io.Copy(c, src); err == nil {
					_ = c.(*net.TCPConn).CloseWrite()
					_, _ = io.Copy(io.Discard, c)
				}
			})
		}
	}()
	go func() {
		defer b.wg.Done()
		buf := make([]byte, 65536)
		for {
			n, peer, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(buf[:n], peer)
		}
	}()
	t.Cleanup(b.stop)
	return b
}

// feedTorture gives p the torture's services.
func feedTorture(p *Proxier, echo, ppEcho, hole, refused *backend) {
	tr := p.Tracker()
	pp := service("pp", []v1.ServicePort{tcpPort("tcp", 80)})
	pp.Annotations = map[string]string{proxy.ProxyProtocolAnnotation: "v1"}
	for _, s := range []*v1.Service{
		service("bulk", []v1.ServicePort{tcpPort("tcp", 80), udpPort("udp", 53)}), pp,
		service("hole", []v1.ServicePort{tcpPort("tcp", 80)}), service("hole2", []v1.ServicePort{tcpPort("tcp", 80)}),
		service("refused", []v1.ServicePort{tcpPort("tcp", 80)}),
	} {
		tr.OnServiceUpdate(nil, s)
	}
	tr.OnEndpointSliceUpdate(nil, slice("bulk", "bulk-tcp", "tcp", v1.ProtocolTCP, echo))
	tr.OnEndpointSliceUpdate(nil, slice("bulk", "bulk-udp", "udp", v1.ProtocolUDP, echo))
	tr.OnEndpointSliceUpdate(nil, slice("pp", "pp-tcp", "tcp", v1.ProtocolTCP, ppEcho))
	tr.OnEndpointSliceUpdate(nil, slice("hole", "hole-tcp", "tcp", v1.ProtocolTCP, hole))
	tr.OnEndpointSliceUpdate(nil, slice("hole2", "hole2-tcp", "tcp", v1.ProtocolTCP, hole))
	tr.OnEndpointSliceUpdate(nil, slice("refused", "refused-tcp", "tcp", v1.ProtocolTCP, refused))
}

// Client kinds, for their streams' seeds.
const (
	kindBulk = iota
	kindPP
	kindIdle
	kindUDP
)

// bulk runs transfers one after another until the stop: each sends a stream of random length
// in random chunks, pausing at random, then half-closes; the echo must come back whole, then EOF.
func (r *torture) bulk(kind, id, port int) {
	rng := rand.New(rand.NewPCG(r.seed, uint64(kind<<32|id)))
	for n := 0; !r.stopping(); n++ {
		total := 1<<10 + rng.IntN(256<<10)
		pause := rng.IntN(4) == 0
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 10*time.Second)
		if err != nil {
			r.fail("kind %d client %d transfer %d: dial the proxy port: %v", kind, id, n, err)
			continue
		}
		r.conns.Add(1)
		_ = c.SetDeadline(time.Now().Add(60 * time.Second))
		wrote := make(chan error, 1)
		go func() {
			src := r.stream(kind, id, n)
			buf := make([]byte, 32<<10)
			prng := rand.New(rand.NewPCG(uint64(id), uint64(n)))
			for left := total; left > 0; {
				k := min(left, 1+prng.IntN(len(buf)))
				_, _ = src.Read(buf[:k])
				if _, err := c.Write(buf[:k]); err != nil {
					wrote <- err
					return
				}
				left -= k
				if pause && prng.IntN(8) == 0 {
					time.Sleep(time.Duration(prng.IntN(100)) * time.Millisecond)
				}
			}
			wrote <- c.(*net.TCPConn).CloseWrite()
		}()
		br := bufio.NewReader(c)
		if kind == kindPP {
			hdr, err := br.ReadString('\n')
			f := strings.Fields(hdr)
			if err != nil || len(f) != 6 || f[4] != strconv.Itoa(c.LocalAddr().(*net.TCPAddr).Port) {
				r.fail("PROXY client %d transfer %d: header %q (%v), want one naming port %d", id, n, hdr, err, c.LocalAddr().(*net.TCPAddr).Port)
				c.Close()
				<-wrote
				continue
			}
		}
		want := r.stream(kind, id, n)
		got, exp := make([]byte, 32<<10), make([]byte, 32<<10)
		read := 0
		var rerr error
		for {
			k, err := br.Read(got)
			if k > 0 {
				if read+k > total {
					r.fail("kind %d client %d transfer %d: %d bytes back, %d sent", kind, id, n, read+k, total)
					rerr = errors.New("too much")
					break
				}
				_, _ = want.Read(exp[:k])
				if !bytes.Equal(got[:k], exp[:k]) {
					r.fail("kind %d client %d transfer %d: bytes %d-%d are not its own (misdelivered or corrupt)", kind, id, n, read, read+k)
					rerr = errors.New("mismatch")
					break
				}
				read += k
				r.bytes.Add(int64(k))
			}
			if err != nil {
				if err != io.EOF {
					rerr = err
				}
				break
			}
		}
		if rerr == nil && read != total {
			r.fail("kind %d client %d transfer %d: EOF after %d of %d bytes (lost)", kind, id, n, read, total)
		} else if rerr != nil && rerr.Error() != "mismatch" && rerr.Error() != "too much" {
			r.fail("kind %d client %d transfer %d: after %d of %d bytes: %v (lost)", kind, id, n, read, total, rerr)
		}
		c.Close()
		if err := <-wrote; err != nil && rerr == nil {
			r.fail("kind %d client %d transfer %d: write: %v", kind, id, n, err)
		}
	}
}

// idle holds a connection that moves a line now and then, many hand-overs apart.
func (r *torture) idle(id, port int) {
	c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 10*time.Second)
	if err != nil {
		r.fail("idle client %d: dial: %v", id, err)
		return
	}
	defer c.Close()
	r.conns.Add(1)
	br := bufio.NewReader(c)
	rng := rand.New(rand.NewPCG(r.seed, uint64(kindIdle<<32|id)))
	for n := 0; ; n++ {
		line := fmt.Sprintf("idle %d %d %x\n", id, n, rng.Uint64())
		_ = c.SetDeadline(time.Now().Add(30 * time.Second))
		if _, err := io.WriteString(c, line); err != nil {
			r.fail("idle client %d line %d: write: %v", id, n, err)
			return
		}
		got, err := br.ReadString('\n')
		if err != nil || got != line {
			r.fail("idle client %d line %d: %q, %v; want its own line back", id, n, got, err)
			return
		}
		select {
		case <-r.stop:
			return
		case <-time.After(time.Duration(500+rng.IntN(3000)) * time.Millisecond):
		}
	}
}

// noAnswer connects to a service whose endpoint never answers (hole: drops SYNs; refused:
// closed port) and checks that no byte ever comes back, only the reset or EOF once the dials
// fail.
func (r *torture) noAnswer(what string, id, port int, count *atomic.Int64) {
	for n := 0; !r.stopping(); n++ {
		count.Add(1)
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 10*time.Second)
		if err != nil { // refused or reset at once: no byte either
			time.Sleep(10 * time.Millisecond)
			continue
		}
		_, _ = io.WriteString(c, "anyone?\n")
		done := make(chan struct{})
		go func() {
			select {
			case <-r.stop:
				_ = c.SetReadDeadline(time.Now())
			case <-done:
			}
		}()
		// Hung up after a while: new connections keep coming to be dialled, on every loop.
		_ = c.SetReadDeadline(time.Now().Add(time.Duration(200+rand.IntN(2000)) * time.Millisecond))
		k, _ := c.Read(make([]byte, 64))
		close(done)
		c.Close()
		if k > 0 {
			r.fail("%s client %d: %d bytes from an endpoint that never answers (misdelivered)", what, id, k)
		}
	}
}

// udp exchanges datagrams tagged with the client and a sequence number; a reply must be the
// client's own, and every exchange must be answered (resent a few times).
func (r *torture) udp(id, port int) {
	c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netipLoopback(port)))
	if err != nil {
		r.fail("UDP client %d: %v", id, err)
		return
	}
	defer c.Close()
	rng := rand.New(rand.NewPCG(r.seed, uint64(kindUDP<<32|id)))
	buf := make([]byte, 2048)
	for seq := 0; !r.stopping(); seq++ {
		msg := fmt.Appendf(nil, "%d %d %x", id, seq, rng.Uint64())
		answered := false
		for try := 0; try < 40 && !answered; try++ {
			if _, err := c.Write(msg); err != nil {
				break // the proxy port refuses while it is not served (ICMP): resend
			}
			_ = c.SetReadDeadline(time.Now().Add(250 * time.Millisecond))
			for {
				k, err := c.Read(buf)
				if err != nil {
					break
				}
				f := strings.Fields(string(buf[:k]))
				if len(f) != 3 || f[0] != strconv.Itoa(id) {
					r.fail("UDP client %d: reply %q is another client's (misdelivered)", id, buf[:k])
					return
				}
				if bytes.Equal(buf[:k], msg) {
					answered = true
					break
				}
				// a late answer to an earlier resend: read on
			}
		}
		if !answered {
			r.fail("UDP client %d: exchange %d never answered (lost)", id, seq)
			return
		}
		r.udpExchanges.Add(1)
		time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
	}
}

// TestHandOverTorture: see the comment at the top of the file.
func TestHandOverTorture(t *testing.T) {
	runs, duration, seed, scale := tortureKnobs(t)
	t.Logf("%d runs of %v from seed %d (KUP_TORTURE_RUNS, KUP_TORTURE_DURATION, KUP_TORTURE_SEED), scale %d", runs, duration, seed, scale)
	for i := range uint64(runs) {
		t.Run(fmt.Sprintf("seed=%d", seed+i), func(t *testing.T) { tortureRun(t, seed+i, duration, scale) })
	}
}

// tortureRun is one run of the torture test, with its own proxiers, clients and endpoints.
func tortureRun(t *testing.T, seed uint64, duration time.Duration, scale int) {
	rng := rand.New(rand.NewPCG(seed, 0))
	echo, ppEcho := tortureEcho(t, "echo", false), tortureEcho(t, "pp", true)
	hole := startBlackHole(t, "hole")
	refused := &backend{name: "refused", addr: netipLoopback(closedLowPort(t, rng))}
	fdsBefore, err := openFDCount()
	if err != nil {
		t.Fatal(err)
	}

	newProxier := func() *Proxier {
		p := New(Options{UDPTimeout: 10 * time.Second})
		p.Tracker().OnSynced()
		feedTorture(p, echo, ppEcho, hole, refused)
		return p
	}
	shutdown := func(p *Proxier) {
		p.closeListeners()
		ctx, cancel := context.WithTimeout(context.Background(), 0)
		defer cancel()
		_ = p.Shutdown(ctx)
	}
	cur := newProxier()
	cur.Sync()
	port := func(name string, proto v1.Protocol) int {
		for _, st := range cur.Ports() {
			if st.ServicePort.Name.Name == name && st.ServicePort.Protocol == proto {
				return st.ProxyPort
			}
		}
		t.Fatalf("no port of %s/%s", name, proto)
		return 0
	}
	bulkPort, udpPort, ppPort := port("bulk", v1.ProtocolTCP), port("bulk", v1.ProtocolUDP), port("pp", v1.ProtocolTCP)
	holePort, hole2Port, refusedPort := port("hole", v1.ProtocolTCP), port("hole2", v1.ProtocolTCP), port("refused", v1.ProtocolTCP)

	r := &torture{t: t, seed: seed, stop: make(chan struct{})}
	var clients sync.WaitGroup
	var stopOnce sync.Once
	stopClients := func() {
		stopOnce.Do(func() { close(r.stop) })
		clients.Wait()
	}
	t.Cleanup(stopClients) // a run that fails halfway stops its clients before their endpoints
	for i := range 12 * scale {
		clients.Go(func() { r.bulk(kindBulk, i, bulkPort) })
	}
	for i := range 4 * scale {
		clients.Go(func() { r.bulk(kindPP, i, ppPort) })
	}
	for i := range 48 * scale {
		clients.Go(func() { r.idle(i, bulkPort) })
	}
	for i := range 8 * scale {
		clients.Go(func() { r.noAnswer("hole", i, holePort, &r.holeConns) })
		clients.Go(func() { r.noAnswer("hole", i, hole2Port, &r.holeConns) })
	}
	for i := range 2 * scale {
		clients.Go(func() { r.noAnswer("refused", i, refusedPort, &r.refusedConns) })
	}
	for i := range 6 * scale {
		clients.Go(func() { r.udp(i, udpPort) })
	}

	handovers, failed, halfway := 0, 0, 0
	// A freeze that comes at once after a thaw or an adoption (no pause, no sync between)
	// meets connections on their way back to the loops: two in three of them do.
	refreezes := map[string]int{}
	var gaveBack string // what the last step did, when it gave connections back: "thaw", "adoption"
	atOnce := func(what string) bool {
		if rng.IntN(3) != 0 {
			gaveBack = what
			return true
		}
		return false
	}
	sock := filepath.Join(t.TempDir(), "h.sock")
	// A short run goes on past its duration until it has done each kind of step (up to three
	// times its duration): a hand-over, a failed one, a freeze at once after giving back.
	covered := func() bool { return handovers > 0 && failed > 0 && refreezes["thaw"]+refreezes["adoption"] > 0 }
	for start := time.Now(); time.Since(start) < duration || (!covered() && time.Since(start) < 3*duration); {
		if gaveBack != "" {
			refreezes[gaveBack]++
			gaveBack = ""
		} else {
			time.Sleep(time.Duration(50+rng.IntN(400)) * time.Millisecond)
		}
		freezeFor := time.Duration(rng.IntN(600)) * time.Millisecond
		switch rng.IntN(6) {
		case 0: // a freeze that fails halfway (out of descriptors, say): what froze thaws
			records, failAt := 0, 1+rng.IntN(40)
			cur.testHookRecord = func(string) error {
				if records++; records == failAt {
					return errors.New("injected failure")
				}
				return nil
			}
			ctx, cancel := context.WithTimeout(context.Background(), freezeFor)
			recs, err := cur.Freeze(ctx)
			cancel()
			cur.testHookRecord = nil
			if err == nil { // fewer records than failAt: fails after the freeze instead
				cur.Resume(recs)
				failed++
			} else {
				halfway++
			}
			if !atOnce("thaw") {
				cur.Sync()
			}
			continue
		case 1, 2: // a hand-over that fails after the freeze: the proxier thaws
			ctx, cancel := context.WithTimeout(context.Background(), freezeFor)
			recs, err := cur.Freeze(ctx)
			cancel()
			if err != nil {
				t.Fatalf("freeze: %v", err)
			}
			time.Sleep(time.Duration(rng.IntN(100)) * time.Millisecond)
			cur.Resume(recs)
			failed++
			if !atOnce("thaw") {
				cur.Sync()
			}
			continue
		}
		ln, err := handover.Listen(sock, zerolog.Nop())
		if err != nil {
			t.Fatal(err)
		}
		g := &holdingGiver{proxierGiver: proxierGiver{p: cur}, freezeFor: freezeFor}
		handed := make(chan bool, 1)
		go func() { handed <- ln.Serve(context.Background(), g, 30*time.Second) }()
		next := newProxier()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		pkg, err := handover.Take(ctx, sock, "torture", func(*os.File) error { return nil }, zerolog.Nop())
		cancel()
		if err != nil {
			t.Fatalf("hand-over %d: %v", handovers+1, err)
		}
		next.Adopt(pkg.Records)
		pkg.Close()
		select {
		case ok := <-handed:
			if !ok || !g.released {
				t.Fatalf("hand-over %d: the old proxier did not hand over", handovers+1)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("hand-over %d: the old proxier's release has not ended after 30s (connections still relay on it)", handovers+1)
			next.Sync()   // relays what was handed over, so that its clients can end
			stopClients() // those relaying on the old proxier end too: its release returns
			<-handed
			shutdown(next)
			shutdown(cur)
			return
		}
		_ = ln.CloseHandedOver()
		shutdown(cur) // released: it holds nothing any more
		next.Sync()   // adopts the connections
		cur = next
		handovers++
		atOnce("adoption")
	}
	stopClients()
	shutdown(cur)

	t.Logf("%d hand-overs, %d failed ones thawed, %d freezes failed halfway; freezes at once after a thaw %d, after an adoption %d; %d TCP connections relayed (%d bytes checked), %d to a black hole, %d refused; %d UDP exchanges",
		handovers, failed, halfway, refreezes["thaw"], refreezes["adoption"], r.conns.Load(), r.bytes.Load(), r.holeConns.Load(), r.refusedConns.Load(), r.udpExchanges.Load())
	for _, f := range r.failures {
		t.Error(f)
	}
	if !covered() {
		t.Errorf("%d hand-overs, %d failed ones and %d freezes at once after a thaw or an adoption: the run proves little",
			handovers, failed, refreezes["thaw"]+refreezes["adoption"])
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, err := openFDCount()
		if err == nil && n <= fdsBefore {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d descriptors open after the run, %d before (%v): %v", n, fdsBefore, err, fdTargets())
		}
		runtime.GC() // the echo endpoints' io.Copy splice pipes, pooled by Go until a collection
		time.Sleep(20 * time.Millisecond)
	}
}

// fdTargets lists this process's open descriptors and what they are.
func fdTargets() []string {
	names, _ := filepath.Glob("/proc/self/fd/*")
	var out []string
	for _, n := range names {
		target, _ := os.Readlink(n)
		out = append(out, filepath.Base(n)+"->"+target)
	}
	return out
}

// closedLowPort returns a loopback port nothing listens on, below the ephemeral range: a dial
// to a closed port of that range may be given the same port as its own and connect to itself
// (TCP's simultaneous open), which would echo.
func closedLowPort(t *testing.T, rng *rand.Rand) int {
	t.Helper()
	low := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil {
				low = v
			}
		}
	}
	from := max(1024, low-10000)
	if from >= low {
		t.Fatalf("the ephemeral port range starts at %d: no port below it for a closed endpoint", low)
	}
	for range 100 {
		port := from + rng.IntN(low-from)
		ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			ln.Close()
			return port
		}
	}
	t.Fatal("no free port below the ephemeral range")
	return 0
}
