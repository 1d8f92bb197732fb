// Package echo is a tiny TCP and UDP echo server, and its client, for tests that need something
// at the end of a connection that proves which backend answered.
//
// The protocol: on a TCP connection the server first writes its banner and "\n", then echoes
// everything it reads until the client closes its side. A UDP datagram is answered with one
// datagram holding the banner, "\n" and the payload. The banner names the backend (a pod name,
// say), so tests of load balancing can tell backends apart.
//
//	ln, err := pod.Listen("tcp", ":8080")
//	srv := echo.ServeTCP(ln, "pod-a")
//	defer srv.Close()
//	banner, err := echo.Check(ctx, node.DialContext, "tcp", "10.96.0.10:80", "hello")
package echo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
)

// maxDatagram bounds the UDP datagrams the server reads.
const maxDatagram = 64 << 10

// Server serves the echo protocol on one listener or packet socket until Close.
type Server struct {
	banner string
	closer io.Closer // the listener or packet socket
	addr   net.Addr
	wg     sync.WaitGroup // the serve goroutine and one per TCP connection

	mu     sync.Mutex // guards following fields
	conns  map[net.Conn]struct{}
	closed bool
}

// ServeTCP serves ln in goroutines of its own until Close. The server owns ln.
func ServeTCP(ln net.Listener, banner string) *Server {
	s := &Server{banner: banner, closer: ln, addr: ln.Addr(), conns: map[net.Conn]struct{}{}}
	s.wg.Add(1)
	go s.acceptLoop(ln)
	return s
}

// ServeUDP serves pc in a goroutine of its own until Close. The server owns pc.
func ServeUDP(pc net.PacketConn, banner string) *Server {
	s := &Server{banner: banner, closer: pc, addr: pc.LocalAddr(), conns: map[net.Conn]struct{}{}}
	s.wg.Add(1)
	go s.udpLoop(pc)
	return s
}

// Addr returns the address the server listens on.
func (s *Server) Addr() net.Addr { return s.addr }

// Close stops the server: it closes the listener and every open connection and waits for the
// server's goroutines to end.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	err := s.closer.Close()
	for c := range s.conns {
		_ = c.Close() // the handler sees the error and ends
	}
	s.mu.Unlock()
	s.wg.Wait()
	if err != nil {
		return fmt.Errorf("close echo server %s: %w", s.addr, err)
	}
	return nil
}

func (s *Server) acceptLoop(ln net.Listener) {
	defer s.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return // closed
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			_ = c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.handle(c)
	}
}

// handle serves one TCP connection.
func (s *Server) handle(c net.Conn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		_ = c.Close()
	}()
	if _, err := io.WriteString(c, s.banner+"\n"); err != nil {
		return
	}
	// Plain reads and writes: a socket spliced onto itself is not worth the surprise.
	buf := make([]byte, 32<<10)
	if _, err := io.CopyBuffer(struct{ io.Writer }{c}, struct{ io.Reader }{c}, buf); err != nil {
		return
	}
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
}

func (s *Server) udpLoop(pc net.PacketConn) {
	defer s.wg.Done()
	buf := make([]byte, maxDatagram)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed || errors.Is(err, net.ErrClosed) {
				return
			}
			continue // e.g. ICMP errors surfacing on the socket
		}
		reply := append([]byte(s.banner+"\n"), buf[:n]...)
		_, _ = pc.WriteTo(reply, from) // a lost reply is the client's timeout
	}
}

// DialFunc dials an address, like net.Dialer.DialContext (or netns.NS.DialContext).
type DialFunc func(ctx context.Context, network, address string) (net.Conn, error)

// Check connects to an echo server at address ("tcp" or "udp"), sends msg, checks that it comes
// back unchanged and returns the server's banner. ctx bounds the whole exchange.
func Check(ctx context.Context, dial DialFunc, network, address, msg string) (string, error) {
	c, err := dial(ctx, network, address)
	if err != nil {
		return "", fmt.Errorf("echo %s %s: %w", network, address, err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		if err := c.SetDeadline(dl); err != nil {
			return "", fmt.Errorf("echo %s %s: set deadline: %w", network, address, err)
		}
	}
	stop := context.AfterFunc(ctx, func() { _ = c.Close() })
	defer stop()
	banner, got, err := exchange(c, network, msg)
	if err != nil {
		return "", fmt.Errorf("echo %s %s: %w", network, address, err)
	}
	if got != msg {
		return banner, fmt.Errorf("echo %s %s: sent %q, got back %q", network, address, msg, got)
	}
	return banner, nil
}

// exchange runs one round of the protocol on c and returns the banner and the echoed message.
func exchange(c net.Conn, network, msg string) (banner, got string, err error) {
	if strings.HasPrefix(network, "udp") {
		if _, err := io.WriteString(c, msg); err != nil {
			return "", "", fmt.Errorf("send: %w", err)
		}
		buf := make([]byte, maxDatagram)
		n, err := c.Read(buf)
		if err != nil {
			return "", "", fmt.Errorf("receive: %w", err)
		}
		banner, got, ok := strings.Cut(string(buf[:n]), "\n")
		if !ok {
			return "", "", fmt.Errorf("reply %q has no banner line", buf[:n])
		}
		return banner, got, nil
	}
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil {
		return "", "", fmt.Errorf("read banner: %w", err)
	}
	// Send while reading: a message larger than the socket buffers would otherwise deadlock.
	sent := make(chan error, 1)
	go func() { sent <- send(c, msg) }()
	back := make([]byte, len(msg))
	_, readErr := io.ReadFull(r, back)
	if readErr != nil {
		_ = c.Close() // unblocks the sender
	}
	sendErr := <-sent
	if readErr != nil {
		return "", "", fmt.Errorf("read echo: %w", readErr)
	}
	if sendErr != nil {
		return "", "", sendErr
	}
	return strings.TrimSuffix(line, "\n"), string(back), nil
}

// send writes msg to c and closes c's sending side.
func send(c net.Conn, msg string) error {
	if _, err := io.WriteString(c, msg); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		if err := cw.CloseWrite(); err != nil {
			return fmt.Errorf("close write: %w", err)
		}
	}
	return nil
}
