package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// TestDripHalfClosed: a connection that drips and is half-closed by the client gets its echoes,
// "eof", numbered drip lines until another connection says "!stop", "dripped COUNT", then EOF.
func TestDripHalfClosed(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go serveTCP(ln, "e", newOpenConns())
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, "hello\n!drip t1 2ms\n"); err != nil {
		t.Fatal(err)
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(c)
	payload := func() string {
		t.Helper()
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("read: %v", err)
		}
		f := strings.SplitN(strings.TrimSuffix(line, "\n"), " ", 3)
		if len(f) != 3 || f[0] != "e" {
			t.Fatalf("malformed line %q", line)
		}
		return f[2]
	}
	for _, want := range []string{"hello", "!drip t1 2ms", "eof"} {
		if got := payload(); got != want {
			t.Fatalf("got %q, want %q", got, want)
		}
	}
	seq := 0
	for ; seq < 5; seq++ {
		if got, want := payload(), fmt.Sprintf("drip t1 %d %s", seq, strings.Repeat("x", seq*53%500)); got != want {
			t.Fatalf("got %.40q, want %.40q", got, want)
		}
	}
	s, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := io.WriteString(s, "!stop t1\n"); err != nil {
		t.Fatal(err)
	}
	for {
		p := payload()
		if strings.HasPrefix(p, "dripped ") {
			if want := fmt.Sprintf("dripped t1 %d", seq); p != want {
				t.Fatalf("got %q, want %q", p, want)
			}
			break
		}
		if want := fmt.Sprintf("drip t1 %d ", seq); !strings.HasPrefix(p, want) {
			t.Fatalf("got %.40q, want %q…", p, want)
		}
		seq++
	}
	if line, err := r.ReadString('\n'); err != io.EOF {
		t.Fatalf("after dripped: %q, %v; want EOF", line, err)
	}
}

// TestStopAnswersAccepted: when the server stops, a connection it had accepted still gets the
// answer to a request sent within the grace, then an orderly close (not a reset), and the
// address refuses new connections.
func TestStopAnswersAccepted(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	open := newOpenConns()
	served := make(chan struct{})
	go func() { defer close(served); serveTCP(ln, "e", open) }()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		open.mu.Lock()
		n := len(open.m)
		open.mu.Unlock()
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the connection was not accepted")
		}
		time.Sleep(time.Millisecond)
	}
	// Stop as serve does: the listener's deadline, then the connections' grace.
	if err := ln.(*net.TCPListener).SetDeadline(time.Now()); err != nil {
		t.Fatal(err)
	}
	<-served
	drained := make(chan struct{})
	go func() { defer close(drained); open.drain(answerDrain) }()
	time.Sleep(answerDrain / 4)
	if _, err := io.WriteString(c, "hello\n"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil || !strings.HasSuffix(line, " hello\n") {
		t.Fatalf("answer %q, %v; want the echo of hello", line, err)
	}
	if line, err := r.ReadString('\n'); err != io.EOF {
		t.Fatalf("after the answer: %q, %v; want EOF (an orderly close)", line, err)
	}
	select {
	case <-drained:
	case <-time.After(10 * time.Second):
		t.Fatal("drain did not return")
	}
	if c2, err := net.Dial("tcp", ln.Addr().String()); err == nil {
		c2.Close()
		t.Error("the stopped server's address still accepts connections")
	}
}
