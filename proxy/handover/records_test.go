package handover

import (
	"encoding/json"
	"net/netip"
	"os"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
)

// metaKeys returns the JSON keys of a record's meta, sorted.
func metaKeys(t *testing.T, r Record) []string {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(r.Meta, &m); err != nil {
		t.Fatal(err)
	}
	var keys []string
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

func devNull(t *testing.T) *os.File {
	t.Helper()
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// A connection's record decodes to the state it was made of, its files in place, with the
// meta's keys of protocol version 1 (a peer of that version reads it); one frozen while
// dialling travels with its client socket alone.
func TestTCPConnRecordRoundTrip(t *testing.T) {
	name := proxy.Name{Namespace: "ns", Name: "svc", Port: "tcp"}
	for _, dialled := range []bool{true, false} {
		cs := forward.TCPConnState{Client: devNull(t), ClientAddr: netip.MustParseAddrPort("10.0.0.1:1234")}
		if dialled {
			cs.Backend = devNull(t)
			cs.Endpoint = netip.MustParseAddrPort("10.0.0.2:80")
			cs.ToEndpoint, cs.ToClient, cs.ToClientDone = []byte("up"), []byte("down"), true
		}
		r, err := TCPConnRecord(name, cs)
		if err != nil {
			t.Fatal(err)
		}
		want := []string{"client", "endpoint", "name", "toClient", "toClientDone", "toEndpoint"}
		if !dialled {
			want = []string{"client", "endpoint", "name"}
		}
		if got := metaKeys(t, r); !slices.Equal(got, want) {
			t.Errorf("dialled %v: meta keys %v, want %v", dialled, got, want)
		}
		gotName, got, err := r.TCPConn()
		if err != nil {
			t.Fatal(err)
		}
		if gotName != name || !reflect.DeepEqual(got, cs) {
			t.Errorf("dialled %v: decoded %v %+v, want %v %+v", dialled, gotName, got, name, cs)
		}
		closeFiles(r.Files)
	}
}

// A record of a connection without an endpoint socket cannot carry bytes in flight.
func TestTCPConnRecordInconsistent(t *testing.T) {
	r, err := NewRecord(KindTCPConn, TCPConnMeta{tcpConnWire: tcpConnWire{ToEndpoint: []byte("x")}}, devNull(t))
	if err != nil {
		t.Fatal(err)
	}
	defer closeFiles(r.Files)
	if _, _, err := r.TCPConn(); err == nil {
		t.Error("a connection with bytes in flight and no endpoint socket decoded")
	}
	r3, err := NewRecord(KindTCPConn, TCPConnMeta{}, devNull(t), devNull(t), devNull(t))
	if err != nil {
		t.Fatal(err)
	}
	defer closeFiles(r3.Files)
	if _, _, err := r3.TCPConn(); err == nil {
		t.Error("a connection record with three descriptors decoded")
	}
}

func TestUDPSessionRecordRoundTrip(t *testing.T) {
	name := proxy.Name{Namespace: "ns", Name: "svc", Port: "udp"}
	s := forward.UDPSessionState{Backend: devNull(t), Client: netip.MustParseAddrPort("10.0.0.1:53"),
		Endpoint: netip.MustParseAddrPort("10.0.0.2:53"), ReplyFrom: netip.MustParseAddr("10.96.0.10"), Idle: time.Second, Refused: true}
	r, err := UDPSessionRecord(name, s)
	if err != nil {
		t.Fatal(err)
	}
	defer closeFiles(r.Files)
	if got, want := metaKeys(t, r), []string{"client", "endpoint", "idle", "name", "refused", "replyFrom"}; !slices.Equal(got, want) {
		t.Errorf("meta keys %v, want %v", got, want)
	}
	gotName, got, err := r.UDPSession()
	if err != nil || gotName != name || !reflect.DeepEqual(got, s) {
		t.Errorf("decoded %v %+v (%v), want %v %+v", gotName, got, err, name, s)
	}
}
