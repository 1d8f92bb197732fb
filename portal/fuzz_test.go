//go:build linux

package portal

import (
	"bytes"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables/netnstest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// FuzzRender renders random but valid portals and configurations and loads the result, with the
// jumps a Manager adds, into a throw-away network namespace with each backend's
// iptables-restore: first with --test, then for real (the kernel checks what --test does not:
// targets, matches and hooks), and reads it back with iptables-save, which must print every
// rendered rule as Render wrote it (partial syncs and the manager's tests compare rule text).
//
// The seed corpus is in testdata/fuzz/FuzzRender. Fuzz with
//
//	go test -run=^$ -fuzz=^FuzzRender$ -fuzztime=10s ./portal
func FuzzRender(f *testing.F) {
	var tools []string
	for _, b := range allBackends {
		tools = append(tools, b.cmd("-restore"), b.cmd("-save"))
	}
	netnstest.RequireTools(f, "Debian package iptables ships both the -nft and the -legacy tools", tools...)
	testenv.Privileged(f) // each input loads in a network namespace of its own
	f.Add([]byte{})
	f.Add([]byte("\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f"))
	f.Add(bytes.Repeat([]byte{0xff}, 256))
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, host, portals := fuzzInput(data)
		nat, filter := Render(cfg, host, portals)
		var backends []backend
		for _, b := range allBackends {
			if b.family == cfg.Family {
				backends = append(backends, b)
			}
		}
		loadRendered(t, backends, nat, filter)
	})
}

// fuzzBytes hands out the fuzzer's bytes; past the end it hands out zeros.
type fuzzBytes struct{ data []byte }

func (f *fuzzBytes) byte() byte {
	if len(f.data) == 0 {
		return 0
	}
	b := f.data[0]
	f.data = f.data[1:]
	return b
}

func (f *fuzzBytes) n(max int) int { return int(f.byte()) % (max + 1) }

func (f *fuzzBytes) uint16() int { return int(f.byte())<<8 | int(f.byte()) }

// port returns 1..65535, often a small or well-known one.
func (f *fuzzBytes) port() int {
	if p := f.uint16(); p != 0 {
		return p
	}
	return 65535
}

// addr returns an address of the family, or of the other one (IPv4-mapped IPv6 among them) when
// the next byte says so.
func (f *fuzzBytes) addr(fam iptables.Family) netip.Addr {
	switch sel := f.byte(); {
	case sel%8 == 7:
		fam = 1 - fam
	case sel%16 == 6:
		return netip.AddrFrom16(netip.AddrFrom4([4]byte{f.byte(), f.byte(), f.byte(), f.byte()}).As16())
	}
	if fam == iptables.IPv6 {
		var b [16]byte
		for i := range b {
			b[i] = f.byte()
		}
		b[0] |= 0x20 // keep IPv4-mapped and such out of the IPv6 addresses proper
		return netip.AddrFrom16(b)
	}
	return netip.AddrFrom4([4]byte{f.byte(), f.byte(), f.byte(), f.byte()})
}

func (f *fuzzBytes) addrs(fam iptables.Family, max int) []netip.Addr {
	var out []netip.Addr
	for range f.n(max) {
		out = append(out, f.addr(fam))
	}
	return out
}

// prefix returns a prefix of either family, not always masked; now and then the zero Prefix.
func (f *fuzzBytes) prefix(fam iptables.Family) netip.Prefix {
	if f.byte()%16 == 15 {
		return netip.Prefix{}
	}
	a := f.addr(fam)
	if a.Is4In6() { // an IPv4 prefix written as IPv6 ("::ffff:10.244.0.0/112")
		return netip.PrefixFrom(a, 96+f.n(32))
	}
	return netip.PrefixFrom(a, f.n(a.BitLen()))
}

func (f *fuzzBytes) prefixes(fam iptables.Family, max int) []netip.Prefix {
	var out []netip.Prefix
	for range f.n(max) {
		out = append(out, f.prefix(fam))
	}
	return out
}

// name returns a DNS label (what namespaces, names and port names are made of), 1..max long.
func (f *fuzzBytes) name(max int) string {
	const chars = "abcdefghijklmnopqrstuvwxyz0123456789-"
	n := 1 + f.n(max-1)
	b := make([]byte, n)
	for i := range b {
		b[i] = chars[int(f.byte())%len(chars)]
	}
	b[0], b[n-1] = 'a'+f.byte()%26, '0'+f.byte()%10
	return string(b)
}

// fuzzInput builds a configuration the proxy could run with and portals a sync could hand it.
func fuzzInput(data []byte) (Config, Host, []Portal) {
	f := &fuzzBytes{data: data}
	fam := iptables.Family(f.byte() % 2)
	cfg := Config{Family: fam}
	switch f.byte() % 4 {
	case 0:
		cfg.BindIP = f.addr(fam)
		if !inFamily(fam, cfg.BindIP) || cfg.BindIP.Unmap().IsUnspecified() {
			cfg.BindIP = netip.Addr{}
		}
	case 1:
		cfg.BindIP = netip.IPv4Unspecified()
	}
	if cfg.HostIP = f.addr(fam); !inFamily(fam, cfg.HostIP) || cfg.HostIP.Unmap().IsUnspecified() {
		cfg.HostIP = netip.MustParseAddr("10.0.0.5")
		if fam == iptables.IPv6 {
			cfg.HostIP = netip.MustParseAddr("fd00::5")
		}
	}
	for _, p := range f.prefixes(fam, 3) {
		if p.IsValid() { // NewManager refuses invalid ones
			cfg.NodePortAddresses = append(cfg.NodePortAddresses, p)
		}
	}
	cfg.ClusterCIDRs = f.prefixes(fam, 2)
	host := Host{NodeIPs: f.addrs(fam, 4)}
	var portals []Portal
	for range f.n(6) {
		ns, name := f.name(63), f.name(63)
		port := ""
		if f.byte()%2 == 1 {
			port = f.name(15)
		}
		p := Portal{
			Comment:  proxy.Name{Namespace: ns, Name: name, Port: port}.String(),
			Protocol: []string{"tcp", "udp"}[f.byte()%2],
			Port:     f.port(),
			Internal: proxy.Action(f.byte() % 3),
			External: proxy.Action(f.byte() % 3),
		}
		if f.byte()%4 != 0 {
			p.ClusterIP = f.addr(fam)
		}
		p.ExternalIPs = f.addrs(fam, 3)
		p.LoadBalancerIPs = f.addrs(fam, 3)
		p.LoadBalancerSourceRanges = f.prefixes(fam, 3)
		if f.byte()%2 == 1 {
			p.NodePort = f.port()
		}
		if p.Internal == proxy.Redirect || p.External == proxy.Redirect || f.byte()%2 == 1 {
			p.ProxyPort = f.port()
		}
		portals = append(portals, p)
	}
	return cfg, host, portals
}

// loadRendered loads Render's output and our jumps into a new, empty network namespace with each
// backend's iptables-restore (--test first, then for real), and checks that iptables-save prints
// every rule as rendered.
func loadRendered(t *testing.T, backends []backend, nat, filter []byte) {
	t.Helper()
	var in bytes.Buffer
	for _, tbl := range []struct {
		name    string
		payload []byte
	}{{tableNAT, nat}, {tableFilter, filter}} {
		in.WriteString("*" + tbl.name + "\n")
		in.Write(tbl.payload)
		for _, j := range jumps() {
			if j.table != tbl.name {
				continue
			}
			in.WriteString("-A " + j.from)
			for _, arg := range j.spec {
				if strings.ContainsAny(arg, " \"") {
					arg = iptables.Quote(arg)
				}
				in.WriteString(" " + arg)
			}
			in.WriteString("\n")
		}
		in.WriteString("COMMIT\n")
	}
	dir := t.TempDir()
	file := filepath.Join(dir, "rules")
	if err := os.WriteFile(file, in.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	// One shell in a network namespace of its own, which ends with it. The backends do not
	// see each other's rules.
	script := "set -e\n"
	for i, b := range backends {
		script += fmt.Sprintf("echo %q >&2; %s --test --noflush < %s; echo %q >&2; %s --noflush < %s; %s > %s/save%d\n",
			b.cmd("-restore")+" --test:", b.cmd("-restore"), file, b.cmd("-restore")+":", b.cmd("-restore"), file, b.cmd("-save"), dir, i)
	}
	cmd := exec.Command("sh", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("the rendered rules are refused: %v: %s\ninput:\n%s", err, strings.TrimSpace(stderr.String()), numbered(in.String()))
	}
	for i, b := range backends {
		out, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("save%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		saved := map[string]bool{}
		for _, l := range strings.Split(string(out), "\n") {
			saved[l] = true
		}
		for _, l := range strings.Split(string(nat)+string(filter), "\n") {
			if strings.HasPrefix(l, "-A ") && !saved[l] {
				t.Errorf("%s prints the rendered rule\n  %s\ndifferently:\n%s", b.cmd("-save"), l, out)
			}
		}
	}
}

func numbered(s string) string {
	var b strings.Builder
	for i, l := range strings.Split(strings.TrimSuffix(s, "\n"), "\n") {
		fmt.Fprintf(&b, "%4d %s\n", i+1, l)
	}
	return b.String()
}
