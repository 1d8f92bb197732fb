// Command kup-echo is the test and example backend of kube-userspace-proxy, and its client.
//
//	kup-echo serve --name NAME --listen IP:PORT [--listen ...]
//
// serves TCP and UDP on every address: for each line (TCP) or datagram (UDP) it receives, it
// answers "NAME PEER PAYLOAD", where PEER is the client address it saw, so a test can tell which
// endpoint answered and whether the client's source address was preserved. On SIGTERM or SIGINT
// it stops as servers users write do (Go's http.Server.Shutdown): its listeners take what their
// accept queues hold for 20 ms and close, and each open connection gets 200 ms more to send a
// request and have its answer before it is closed (an orderly close, not a reset).
//
// On TCP, the line "!drip ID INTERVAL" (answered like any other) makes the server also send
// "NAME PEER drip ID SEQ PADDING" every INTERVAL (SEQ from 0, PADDING some x's) until the line
// "!stop ID" arrives on any connection to this server; it then sends "NAME PEER dripped ID
// COUNT" and, if the client has closed its side meanwhile, closes the connection. A client
// that half-closes while its connection drips gets "NAME PEER eof" first, then the drip goes
// on: a half-closed connection that carries data for as long as a test wants.
//
//	kup-echo request --tcp|--udp IP:PORT [--count N] [--timeout D]
//
// sends N requests, one per new connection (TCP) or socket (UDP), and prints each answer's first
// two fields ("NAME PEER"); it exits non-zero on the first failure. IP may be a name.
//
//	kup-echo resolve --udp|--tcp [--server IP:PORT] [--timeout D] NAME...
//
// looks each NAME's IPv4 addresses up with Go's own resolver (the search list and nameservers of
// /etc/resolv.conf, as a pod's), every query over UDP alone or TCP alone, to --server if given,
// and prints "NAME ADDRESS..." (sorted) for each; a name that does not resolve is reported on
// standard error, and the exit status is non-zero if any did not. A DNS client for a pod whose
// image has nothing but this binary.
package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/pflag"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: kup-echo serve|request|resolve [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(os.Args[2:])
	case "request":
		err = request(os.Args[2:], os.Stdout)
	case "resolve":
		err = resolve(os.Args[2:], os.Stdout)
	default:
		err = fmt.Errorf("unknown command %q (want serve, request or resolve)", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kup-echo:", err)
		os.Exit(1)
	}
}

func serve(args []string) error {
	fs := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	name := fs.String("name", "echo", "name reported in every answer")
	listen := fs.StringSlice("listen", []string{"127.0.0.1:8080"}, "IP:PORT to serve TCP and UDP on (repeatable)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	var wg sync.WaitGroup
	var (
		listeners []*net.TCPListener
		packets   []io.Closer
	)
	open := newOpenConns()
	for _, addr := range *listen {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return err
		}
		pc, err := net.ListenPacket("udp", addr)
		if err != nil {
			return err
		}
		listeners, packets = append(listeners, ln.(*net.TCPListener)), append(packets, pc)
		wg.Add(2)
		go func() { defer wg.Done(); serveTCP(ln, *name, open) }()
		go func() { defer wg.Done(); serveUDP(pc, *name) }()
	}
	fmt.Fprintf(os.Stderr, "kup-echo %s serving %s\n", *name, strings.Join(*listen, ", "))
	<-ctx.Done()
	// Stop as servers users write do (Go's http.Server.Shutdown): stop listening, and answer
	// what was accepted. The listeners first take what their accept queues hold (closing a
	// listener resets the connections queued in it), for acceptDrain, then close.
	for _, ln := range listeners {
		_ = ln.SetDeadline(time.Now().Add(acceptDrain))
	}
	for _, c := range packets {
		c.Close()
	}
	wg.Wait()
	open.drain(answerDrain)
	return nil
}

// How kup-echo stops (serve): the time its listeners keep accepting what their queues hold, and
// the time its connections have for a request already on its way.
const (
	acceptDrain = 20 * time.Millisecond
	answerDrain = 200 * time.Millisecond
)

// openConns are the TCP connections being served, so that a stop can let them finish.
type openConns struct {
	mu      sync.Mutex
	m       map[net.Conn]struct{}
	closing bool
	wg      sync.WaitGroup
}

func newOpenConns() *openConns { return &openConns{m: map[net.Conn]struct{}{}} }

// add registers c; false once the server is stopping.
func (o *openConns) add(c net.Conn) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closing {
		return false
	}
	o.m[c] = struct{}{}
	o.wg.Add(1)
	return true
}

func (o *openConns) remove(c net.Conn) {
	o.mu.Lock()
	delete(o.m, c)
	o.mu.Unlock()
	o.wg.Done()
}

// drain gives every connection grace to send a request and have its answer, then waits until
// each has closed: the read that follows times out and ends it (drips stop with it).
func (o *openConns) drain(grace time.Duration) {
	o.mu.Lock()
	o.closing = true
	for c := range o.m {
		_ = c.SetReadDeadline(time.Now().Add(grace))
	}
	o.mu.Unlock()
	o.wg.Wait()
}

// serveTCP accepts and serves until ln is closed or its deadline (set when the server stops)
// passes.
func serveTCP(ln net.Listener, name string, open *openConns) {
	defer ln.Close()
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || errors.Is(err, os.ErrDeadlineExceeded) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if !open.add(c) {
			c.Close()
			continue
		}
		go func() {
			defer open.remove(c)
			serveConn(c, name)
		}()
	}
}

// drips are the connections dripping (see the package documentation), by ID: closing the
// channel stops one.
var drips = struct {
	sync.Mutex
	m map[string]chan struct{}
}{m: map[string]chan struct{}{}}

// serveConn echoes the lines of one TCP connection and runs its drips.
func serveConn(c net.Conn, name string) {
	defer c.Close()
	var wmu sync.Mutex
	write := func(format string, args ...any) error {
		wmu.Lock()
		defer wmu.Unlock()
		_, err := fmt.Fprintf(c, "%s %s "+format, append([]any{name, c.RemoteAddr()}, args...)...)
		return err
	}
	failed := make(chan struct{}) // the connection broke: drips stop
	var dripping sync.WaitGroup
	active := 0
	r := bufio.NewReader(c)
	for {
		line, err := r.ReadString('\n')
		if line != "" {
			if werr := write("%s", line); werr != nil {
				close(failed)
				break
			}
			if id, every, ok := parseDrip(line); ok {
				stop := make(chan struct{})
				drips.Lock()
				drips.m[id] = stop
				drips.Unlock()
				active++
				dripping.Go(func() { drip(id, every, stop, failed, write) })
			} else if id, ok := strings.CutPrefix(strings.TrimSpace(line), "!stop "); ok {
				drips.Lock()
				if stop, ok := drips.m[id]; ok {
					close(stop)
					delete(drips.m, id)
				}
				drips.Unlock()
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) && active > 0 {
				_ = write("eof\n")
			} else {
				close(failed)
			}
			break
		}
	}
	dripping.Wait()
}

// parseDrip parses "!drip ID INTERVAL".
func parseDrip(line string) (id string, every time.Duration, ok bool) {
	f := strings.Fields(line)
	if len(f) != 3 || f[0] != "!drip" {
		return "", 0, false
	}
	every, err := time.ParseDuration(f[2])
	if err != nil || every <= 0 {
		return "", 0, false
	}
	return f[1], every, true
}

// drip sends numbered lines every interval until stop (then "dripped ID COUNT") or failed.
func drip(id string, every time.Duration, stop, failed <-chan struct{}, write func(string, ...any) error) {
	t := time.NewTicker(every)
	defer t.Stop()
	for seq := 0; ; seq++ {
		select {
		case <-stop:
			_ = write("dripped %s %d\n", id, seq)
			return
		case <-failed:
			return
		case <-t.C:
		}
		if write("drip %s %d %s\n", id, seq, strings.Repeat("x", seq*53%500)) != nil {
			return
		}
	}
}

func serveUDP(pc net.PacketConn, name string) {
	buf := make([]byte, 65536)
	for {
		n, peer, err := pc.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		reply := fmt.Appendf(nil, "%s %s %s", name, peer, buf[:n])
		_, _ = pc.WriteTo(reply, peer)
	}
}

func request(args []string, out io.Writer) error {
	fs := pflag.NewFlagSet("request", pflag.ContinueOnError)
	tcp := fs.String("tcp", "", "TCP IP:PORT to send to")
	udp := fs.String("udp", "", "UDP IP:PORT to send to")
	count := fs.Int("count", 1, "number of requests, each on a new connection or socket")
	timeout := fs.Duration("timeout", 3*time.Second, "timeout per request")
	if err := fs.Parse(args); err != nil {
		return err
	}
	network, addr := "tcp", *tcp
	if *udp != "" {
		network, addr = "udp", *udp
	}
	if addr == "" {
		return errors.New("request: --tcp or --udp is required")
	}
	for i := range *count {
		answer, err := Ask(network, addr, fmt.Sprintf("request-%d", i), *timeout)
		if err != nil {
			return fmt.Errorf("request %d to %s %s: %w", i, network, addr, err)
		}
		f := strings.Fields(answer)
		if len(f) < 2 {
			return fmt.Errorf("request %d: malformed answer %q", i, answer)
		}
		fmt.Fprintln(out, f[0], f[1])
	}
	return nil
}

// Ask sends one request on a new connection (or socket) and returns the answer line.
func Ask(network, addr, payload string, timeout time.Duration) (string, error) {
	c, err := net.DialTimeout(network, addr, timeout)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := io.WriteString(c, payload+"\n"); err != nil {
		return "", err
	}
	if network == "udp" {
		buf := make([]byte, 65536)
		n, err := c.Read(buf)
		if err != nil {
			return "", err
		}
		return strings.TrimSpace(string(buf[:n])), nil
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(line), nil
}

func resolve(args []string, out io.Writer) error {
	fs := pflag.NewFlagSet("resolve", pflag.ContinueOnError)
	udp := fs.Bool("udp", false, "query over UDP only")
	tcp := fs.Bool("tcp", false, "query over TCP only")
	server := fs.String("server", "", "IP:PORT of the DNS server (default: the nameservers of /etc/resolv.conf)")
	timeout := fs.Duration("timeout", 5*time.Second, "timeout of each name's lookup")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *udp == *tcp {
		return errors.New("resolve: one of --udp or --tcp is required")
	}
	if fs.NArg() == 0 {
		return errors.New("resolve: a NAME is required")
	}
	network := "udp"
	if *tcp {
		network = "tcp"
	}
	failed := 0
	for _, name := range fs.Args() {
		ctx, cancel := context.WithTimeout(context.Background(), *timeout)
		ips, err := Resolve(ctx, network, *server, name)
		cancel()
		if err != nil {
			fmt.Fprintln(os.Stderr, "kup-echo:", err)
			failed++
			continue
		}
		fmt.Fprintln(out, name, strings.Join(ips, " "))
	}
	if failed > 0 {
		return fmt.Errorf("resolve: %d of %d names did not resolve", failed, fs.NArg())
	}
	return nil
}

// Resolve looks name's IPv4 addresses up with Go's resolver, every query over network ("udp" or
// "tcp") to server, or to /etc/resolv.conf's nameservers when server is empty, and returns them
// sorted.
func Resolve(ctx context.Context, network, server, name string) ([]string, error) {
	r := &net.Resolver{
		PreferGo: true,
		// The resolver dials "udp" first (TCP after a truncated answer): whatever it asks for,
		// this network. It speaks DNS over TCP on any connection that is not a PacketConn.
		Dial: func(ctx context.Context, _, address string) (net.Conn, error) {
			if server != "" {
				address = server
			}
			var d net.Dialer
			return d.DialContext(ctx, network, address)
		},
	}
	ips, err := r.LookupIP(ctx, "ip4", name)
	if err != nil {
		return nil, fmt.Errorf("resolve %s over %s: %w", name, network, err)
	}
	out := make([]string, 0, len(ips))
	for _, ip := range ips {
		out = append(out, ip.String())
	}
	slices.Sort(out)
	return out, nil
}
