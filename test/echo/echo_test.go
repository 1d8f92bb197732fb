package echo_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/echo"
)

func TestEchoOnLoopback(t *testing.T) {
	tests := []struct {
		name    string
		network string
		msg     string
	}{
		{name: "tcp", network: "tcp", msg: "hello"},
		{name: "tcp large", network: "tcp", msg: strings.Repeat("x", 32<<20)},
		{name: "tcp empty", network: "tcp", msg: ""},
		{name: "udp", network: "udp", msg: "hello"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var srv *echo.Server
			if tc.network == "tcp" {
				ln, err := net.Listen("tcp4", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				srv = echo.ServeTCP(ln, "b1")
			} else {
				pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				srv = echo.ServeUDP(pc, "b1")
			}
			defer srv.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			var d net.Dialer
			banner, err := echo.Check(ctx, d.DialContext, tc.network, srv.Addr().String(), tc.msg)
			if err != nil {
				t.Fatal(err)
			}
			if banner != "b1" {
				t.Errorf("banner = %q, want b1", banner)
			}
		})
	}
}

func TestCloseEndsOpenConnections(t *testing.T) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := echo.ServeTCP(ln, "")
	c, err := net.Dial("tcp4", srv.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 1)
	if _, err := c.Read(buf); err != nil || buf[0] != '\n' {
		t.Fatalf("read empty banner line: %q, %v", buf, err)
	}
	if err := srv.Close(); err != nil { // returns only once the handler has ended
		t.Fatal(err)
	}
	if err := c.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if n, err := c.Read(buf); err == nil {
		t.Errorf("connection still open after Close (read %d bytes)", n)
	}
	if _, err := net.Dial("tcp4", srv.Addr().String()); err == nil {
		t.Error("listener still accepting after Close")
	}
}

func TestCheckDetectsWrongEcho(t *testing.T) {
	// A server that answers with a banner and then something else than what it got.
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = c.Write([]byte("liar\nHELLO"))
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var d net.Dialer
	if _, err := echo.Check(ctx, d.DialContext, "tcp", ln.Addr().String(), "hello"); err == nil {
		t.Error("Check accepted a wrong echo")
	}
	<-done
}
