//go:build linux

package app

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

func TestConntrackSettingsFromOptions(t *testing.T) {
	tests := []struct {
		name string
		args []string
		cpus int
		want conntrackSettings
	}{
		{name: "defaults leave everything alone", cpus: 8},
		{name: "per core wins over min", args: []string{"--conntrack-max-per-core=32768"}, cpus: 8, want: conntrackSettings{Max: 262144}},
		{name: "min wins over per core", args: []string{"--conntrack-max-per-core=32768"}, cpus: 2, want: conntrackSettings{Max: DefaultConntrackMin}},
		{name: "min alone sets nothing", args: []string{"--conntrack-min=500000"}, cpus: 2},
		{name: "timeouts", args: []string{"--conntrack-tcp-timeout-established=24h", "--conntrack-tcp-timeout-close-wait=1h",
			"--conntrack-udp-timeout=30s", "--conntrack-udp-timeout-stream=2m", "--conntrack-tcp-be-liberal"}, cpus: 1,
			want: conntrackSettings{TCPEstablishedTimeout: 24 * time.Hour, TCPCloseWaitTimeout: time.Hour, UDPTimeout: 30 * time.Second,
				UDPStreamTimeout: 2 * time.Minute, TCPBeLiberal: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := parse(t, tt.args...)
			if err != nil {
				t.Fatal(err)
			}
			if got := o.conntrackSettings(tt.cpus); got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestValidateConntrack(t *testing.T) {
	for _, tt := range []struct{ arg, want string }{
		{"--conntrack-max-per-core=-1", "--conntrack-max-per-core: -1: must not be negative"},
		{"--conntrack-min=-5", "--conntrack-min: -5: must not be negative"},
		{"--conntrack-tcp-timeout-established=-1s", "--conntrack-tcp-timeout-established: -1s"},
		{"--conntrack-udp-timeout=500ms", "--conntrack-udp-timeout: 500ms: must be 0 (leave the sysctl alone) or at least 1s"},
	} {
		t.Run(tt.arg, func(t *testing.T) {
			o, err := parse(t, tt.arg, "--hostname-override=n")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := o.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Validate = %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

// fakeSysctls lays out the conntrack sysctls and the hash table size under temporary procfs
// and sysfs roots, with the values proc writes them in (a trailing newline: a file that still
// has it was not written).
func fakeSysctls(t *testing.T, hashsize int) conntrackSysctls {
	t.Helper()
	c := conntrackSysctls{procRoot: t.TempDir(), sysRoot: t.TempDir(), log: zerolog.Nop()}
	write := func(path string, v int) {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(strconv.Itoa(v)+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for name, v := range map[string]int{"nf_conntrack_max": 65536, "nf_conntrack_tcp_timeout_established": 432000,
		"nf_conntrack_tcp_timeout_close_wait": 60, "nf_conntrack_tcp_be_liberal": 0, "nf_conntrack_udp_timeout": 30,
		"nf_conntrack_udp_timeout_stream": 120} {
		write(filepath.Join(c.procRoot, "sys/net/netfilter", name), v)
	}
	write(filepath.Join(c.sysRoot, hashsizePath), hashsize)
	return c
}

// contents returns every file under the two roots, by path relative to its root.
func (c conntrackSysctls) contents(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, root := range []string{c.procRoot, c.sysRoot} {
		err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			b, err := os.ReadFile(path)
			rel, _ := filepath.Rel(root, path)
			out[rel] = string(b)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func TestConntrackSysctlsApply(t *testing.T) {
	const (
		est   = "sys/net/netfilter/nf_conntrack_tcp_timeout_established"
		cw    = "sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait"
		lib   = "sys/net/netfilter/nf_conntrack_tcp_be_liberal"
		udp   = "sys/net/netfilter/nf_conntrack_udp_timeout"
		udps  = "sys/net/netfilter/nf_conntrack_udp_timeout_stream"
		maxCT = "sys/net/netfilter/nf_conntrack_max"
	)
	tests := []struct {
		name     string
		hashsize int
		s        conntrackSettings
		// changed: the files written and their new contents; every other file is unchanged.
		changed map[string]string
	}{
		{name: "nothing asked: nothing written", hashsize: 16384},
		{name: "every sysctl", hashsize: 16384,
			s: conntrackSettings{Max: 262144, TCPEstablishedTimeout: 24 * time.Hour, TCPCloseWaitTimeout: time.Hour,
				TCPBeLiberal: true, UDPTimeout: 45 * time.Second, UDPStreamTimeout: 3 * time.Minute},
			changed: map[string]string{maxCT: "262144", hashsizePath: "65536", est: "86400", cw: "3600", lib: "1", udp: "45", udps: "180"}},
		{name: "hash table already large enough", hashsize: 65536, s: conntrackSettings{Max: 262144},
			changed: map[string]string{maxCT: "262144"}},
		{name: "values already set are not rewritten", hashsize: 16384,
			s:       conntrackSettings{Max: 65536, TCPEstablishedTimeout: 432000 * time.Second, UDPTimeout: 31 * time.Second},
			changed: map[string]string{udp: "31"}},
		{name: "timeouts in whole seconds", hashsize: 16384, s: conntrackSettings{TCPCloseWaitTimeout: 90500 * time.Millisecond},
			changed: map[string]string{cw: "90"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := fakeSysctls(t, tt.hashsize)
			before := c.contents(t)
			if errs := c.apply(tt.s); len(errs) != 0 {
				t.Fatalf("apply: %v", errs)
			}
			after := c.contents(t)
			for path, was := range before {
				want, ok := tt.changed[path]
				if !ok {
					want = was
				}
				if after[path] != want {
					t.Errorf("%s = %q, want %q", path, after[path], want)
				}
			}
		})
	}
}

// TestConntrackSysctlsMissing: without the nf_conntrack module the sysctls do not exist; each one
// asked for is reported (and nothing is created).
func TestConntrackSysctlsMissing(t *testing.T) {
	c := conntrackSysctls{procRoot: t.TempDir(), sysRoot: t.TempDir(), log: zerolog.Nop()}
	errs := c.apply(conntrackSettings{Max: 1 << 20, TCPEstablishedTimeout: time.Hour})
	if len(errs) != 2 {
		t.Fatalf("errors %v, want one per sysctl asked for", errs)
	}
	for _, err := range errs {
		if !strings.Contains(err.Error(), "nf_conntrack module") {
			t.Errorf("error %q does not say why", err)
		}
	}
	if got := c.contents(t); len(got) != 0 {
		t.Errorf("created %v", got)
	}
}

// TestConntrackSysctlsInNetns writes the real sysctls of a fresh network namespace, never the
// machine's own: nf_conntrack_tcp_timeout_established is per namespace and is set there;
// nf_conntrack_max is the machine's and read-only outside the initial namespace, so it is
// reported and left alone. The hash table size goes to a temporary sysfs root in any case.
func TestConntrackSysctlsInNetns(t *testing.T) {
	const estPath = "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established"
	const maxPath = "/proc/sys/net/netfilter/nf_conntrack_max"
	hostEst, err := readInt(estPath)
	if err != nil {
		t.Fatalf("%v (the nf_conntrack module must be loaded)", err)
	}
	hostMax, err := readInt(maxPath)
	if err != nil {
		t.Fatal(err)
	}
	want := 4321
	if hostEst == want {
		want++
	}
	sysRoot := t.TempDir()
	if err := os.MkdirAll(filepath.Join(sysRoot, filepath.Dir(hashsizePath)), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sysRoot, hashsizePath), []byte("16\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	ns := netns.New(t, "ct")
	var logs bytes.Buffer
	var errs []error
	var nsEst, nsMax int
	err = ns.Do(func() error {
		c := conntrackSysctls{procRoot: "/proc", sysRoot: sysRoot, log: zerolog.New(&logs)}
		errs = c.apply(conntrackSettings{Max: hostMax + 1024, TCPEstablishedTimeout: time.Duration(want) * time.Second})
		var err error
		if nsEst, err = readInt(estPath); err != nil {
			return err
		}
		nsMax, err = readInt(maxPath)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if nsEst != want {
		t.Errorf("namespace's nf_conntrack_tcp_timeout_established = %d, want %d (errors %v)", nsEst, want, errs)
	}
	switch {
	case len(errs) == 1 && strings.Contains(errs[0].Error(), "nf_conntrack_max") &&
		strings.Contains(errs[0].Error(), "read-only outside the host's initial network namespace"):
	case len(errs) == 0 && nsMax == hostMax+1024: // a kernel with a per-namespace nf_conntrack_max
	default:
		t.Errorf("errors %v (namespace's nf_conntrack_max %d), want one saying nf_conntrack_max is read-only", errs, nsMax)
	}
	if got, _ := readInt(estPath); got != hostEst {
		t.Errorf("the machine's nf_conntrack_tcp_timeout_established changed: %d, was %d", got, hostEst)
	}
	if got, _ := readInt(maxPath); got != hostMax {
		t.Errorf("the machine's nf_conntrack_max changed: %d, was %d", got, hostMax)
	}
	if t.Failed() {
		t.Logf("logs:\n%s", logs.String())
	}
}

// TestValidateTCPDataPath: the deprecated --tcp-data-path takes loop, the only data path;
// goroutine, the removed one, is refused with the reason; --tcp-park-idle-after, which applied
// to goroutine only, is accepted and ignored.
func TestValidateTCPDataPath(t *testing.T) {
	for _, tt := range []struct{ arg, wantErr string }{
		{"--tcp-data-path=loop", ""},
		{"--tcp-park-idle-after=250ms", ""},
		{"--tcp-data-path=goroutine", `--tcp-data-path: "goroutine": the goroutine TCP data path was removed`},
		{"--tcp-data-path=epoll", `--tcp-data-path: "epoll": the flag is deprecated; its only value is "loop"`},
	} {
		t.Run(tt.arg, func(t *testing.T) {
			o, err := parse(t, tt.arg, "--hostname-override=n")
			if err != nil {
				t.Fatal(err)
			}
			_, err = o.Validate()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("Validate = %v, want no error", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("Validate = %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
	if o := NewOptions(); o.TCPDataPath != "" {
		t.Errorf("default --tcp-data-path %q, want none", o.TCPDataPath)
	}
}

// TestConntrackOnly: --conntrack-only sets the conntrack sysctls it is asked for in the caller's
// network namespace and exits 0 without serving, also when one of them cannot be set (a
// warning, as at a proxy's start).
func TestConntrackOnly(t *testing.T) {
	const closeWaitPath = "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait"
	host, err := readInt(closeWaitPath)
	if err != nil {
		t.Fatalf("%v (the nf_conntrack module must be loaded)", err)
	}
	want := 3600
	if host == want {
		want++
	}
	ns := netns.New(t, "cto")
	var stdout, stderr bytes.Buffer
	var code, got int
	err = ns.Do(func() error {
		// nf_conntrack_max cannot be set outside the initial namespace: a warning, not a failure.
		code = Main([]string{"--conntrack-only", "--conntrack-max-per-core=32768",
			fmt.Sprintf("--conntrack-tcp-timeout-close-wait=%ds", want)}, &stdout, &stderr)
		var err error
		got, err = readInt(closeWaitPath)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if code != 0 {
		t.Errorf("exit code %d, want 0", code)
	}
	if got != want {
		t.Errorf("namespace's nf_conntrack_tcp_timeout_close_wait = %d, want %d", got, want)
	}
	if !strings.Contains(stderr.String(), "nf_conntrack_max") || !strings.Contains(stderr.String(), "left alone") {
		t.Errorf("no warning about nf_conntrack_max in the log")
	}
	if strings.Contains(stderr.String(), "descriptor budget") {
		t.Errorf("--conntrack-only started the proxy")
	}
	if now, _ := readInt(closeWaitPath); now != host {
		t.Errorf("the machine's nf_conntrack_tcp_timeout_close_wait changed: %d, was %d", now, host)
	}
	if t.Failed() {
		t.Logf("log:\n%s", stderr.String())
	}
}
