// Command kup-echo is the test and example backend of kube-userspace-proxy, and its client.
//
//	kup-echo serve --name NAME --listen IP:PORT [--listen ...]
//
// serves TCP and UDP on every address: for each line (TCP) or datagram (UDP) it receives, it
// answers "NAME PEER PAYLOAD", where PEER is the client address it saw, so a test can tell which
// endpoint answered and whether the client's source address was preserved.
//
//	kup-echo request --tcp|--udp IP:PORT [--count N] [--timeout D]
//
// sends N requests, one per new connection (TCP) or socket (UDP), and prints each answer's first
// two fields ("NAME PEER"); it exits non-zero on the first failure.
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
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/pflag"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: kup-echo serve|request [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(os.Args[2:])
	case "request":
		err = request(os.Args[2:], os.Stdout)
	default:
		err = fmt.Errorf("unknown command %q (want serve or request)", os.Args[1])
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
	var closers []io.Closer
	for _, addr := range *listen {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return err
		}
		pc, err := net.ListenPacket("udp", addr)
		if err != nil {
			return err
		}
		closers = append(closers, ln, pc)
		wg.Add(2)
		go func() { defer wg.Done(); serveTCP(ln, *name) }()
		go func() { defer wg.Done(); serveUDP(pc, *name) }()
	}
	fmt.Fprintf(os.Stderr, "kup-echo %s serving %s\n", *name, strings.Join(*listen, ", "))
	<-ctx.Done()
	for _, c := range closers {
		c.Close()
	}
	wg.Wait()
	return nil
}

func serveTCP(ln net.Listener, name string) {
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		go func() {
			defer c.Close()
			r := bufio.NewReader(c)
			for {
				line, err := r.ReadString('\n')
				if line != "" {
					if _, werr := fmt.Fprintf(c, "%s %s %s", name, c.RemoteAddr(), line); werr != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
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
