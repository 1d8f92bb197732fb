package main

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// dnsServer answers every A question for want with addrs, over UDP and TCP on one loopback port,
// and counts the queries each way.
type dnsServer struct {
	addr     string
	udp, tcp atomic.Int64
}

func startDNS(t *testing.T, want string, addrs ...[4]byte) *dnsServer {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", pc.LocalAddr().String())
	if err != nil {
		pc.Close()
		t.Fatal(err)
	}
	s := &dnsServer{addr: pc.LocalAddr().String()}
	answer := func(q []byte) []byte {
		var m dnsmessage.Message
		if err := m.Unpack(q); err != nil || len(m.Questions) != 1 {
			return nil
		}
		m.Header.Response, m.Header.Authoritative = true, true
		qq := m.Questions[0]
		if qq.Name.String() != want {
			m.Header.RCode = dnsmessage.RCodeNameError
		} else if qq.Type == dnsmessage.TypeA {
			for _, a := range addrs {
				m.Answers = append(m.Answers, dnsmessage.Resource{
					Header: dnsmessage.ResourceHeader{Name: qq.Name, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: 5},
					Body:   &dnsmessage.AResource{A: a},
				})
			}
		}
		b, err := m.Pack()
		if err != nil {
			return nil
		}
		return b
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		buf := make([]byte, 1500)
		for {
			n, peer, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			s.udp.Add(1)
			if b := answer(buf[:n]); b != nil {
				_, _ = pc.WriteTo(b, peer)
			}
		}
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				for {
					var l [2]byte
					if _, err := io.ReadFull(c, l[:]); err != nil {
						return
					}
					q := make([]byte, binary.BigEndian.Uint16(l[:]))
					if _, err := io.ReadFull(c, q); err != nil {
						return
					}
					s.tcp.Add(1)
					b := answer(q)
					if b == nil {
						return
					}
					if _, err := c.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(b))), b...)); err != nil {
						return
					}
				}
			})
		}
	})
	t.Cleanup(func() {
		pc.Close()
		ln.Close()
		wg.Wait()
	})
	return s
}

// TestResolveOverEachNetwork: --udp sends every query over UDP and --tcp every one over TCP, and
// both return the server's addresses, sorted.
func TestResolveOverEachNetwork(t *testing.T) {
	const name = "echo.kup-e2e.svc.cluster.local."
	for _, network := range []string{"udp", "tcp"} {
		t.Run(network, func(t *testing.T) {
			s := startDNS(t, name, [4]byte{10, 96, 7, 9}, [4]byte{10, 96, 0, 12})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			got, err := Resolve(ctx, network, s.addr, name)
			if err != nil {
				t.Fatal(err)
			}
			if want := []string{"10.96.0.12", "10.96.7.9"}; !slices.Equal(got, want) {
				t.Errorf("Resolve over %s: %v, want %v", network, got, want)
			}
			udp, tcp := s.udp.Load(), s.tcp.Load()
			if network == "udp" && (udp == 0 || tcp != 0) || network == "tcp" && (tcp == 0 || udp != 0) {
				t.Errorf("over %s: the server saw %d UDP and %d TCP queries", network, udp, tcp)
			}
		})
	}
}

// TestResolveUnknownName: a name the server does not know is an error naming it.
func TestResolveUnknownName(t *testing.T) {
	s := startDNS(t, "known.example.")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := Resolve(ctx, "tcp", s.addr, "unknown.example.")
	var dnsErr *net.DNSError
	if !errors.As(err, &dnsErr) || !dnsErr.IsNotFound {
		t.Errorf("Resolve of an unknown name: %v, want a not-found DNSError", err)
	}
}
