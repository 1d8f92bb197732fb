package app

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
)

// parse registers fresh options on a flag set, parses args, and completes them (--config).
func parse(t *testing.T, args ...string) (*Options, error) {
	t.Helper()
	o, _, err := parseFlags(t, args...)
	return o, err
}

// parseFlags is parse that also returns the flag set.
func parseFlags(t *testing.T, args ...string) (*Options, *pflag.FlagSet, error) {
	t.Helper()
	o := NewOptions()
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	fs.SetOutput(&bytes.Buffer{})
	o.AddFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatalf("parse %v: %v", args, err)
	}
	return o, fs, o.Complete(fs)
}

func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

const header = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"

func TestConfigFile(t *testing.T) {
	full := header + `
clientConnection:
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
hostnameOverride: node-a
bindAddress: 10.0.0.1
healthzBindAddress: 0.0.0.0:20256
metricsBindAddress: 127.0.0.1:20249
nodePortAddresses: [10.0.0.0/24, 192.168.0.0/16]
iptables:
  syncPeriod: 45s
  minSyncPeriod: 2s
oomScoreAdj: -500
portRange: 30000-31000
mode: userspace
`
	tests := []struct {
		name    string
		content string
		args    []string
		check   func(t *testing.T, o *Options)
		wantErr string // substring; empty means success
	}{
		{
			name: "every mapped field", content: full,
			check: func(t *testing.T, o *Options) {
				want := Options{Kubeconfig: "/var/lib/kube-proxy/kubeconfig.conf", HostnameOverride: "node-a", BindAddress: "10.0.0.1",
					HealthzBindAddress: "0.0.0.0:20256", MetricsBindAddress: "127.0.0.1:20249", SyncPeriod: 45 * time.Second,
					MinSyncPeriod: 2 * time.Second, OOMScoreAdj: -500, ProxyPortRange: "30000-31000"}
				got := Options{Kubeconfig: o.Kubeconfig, HostnameOverride: o.HostnameOverride, BindAddress: o.BindAddress,
					HealthzBindAddress: o.HealthzBindAddress, MetricsBindAddress: o.MetricsBindAddress, SyncPeriod: o.SyncPeriod,
					MinSyncPeriod: o.MinSyncPeriod, OOMScoreAdj: o.OOMScoreAdj, ProxyPortRange: o.ProxyPortRange}
				if !equalOptions(got, want) {
					t.Errorf("got %+v\nwant %+v", got, want)
				}
				if strings.Join(o.NodePortAddresses, ",") != "10.0.0.0/24,192.168.0.0/16" {
					t.Errorf("NodePortAddresses = %v", o.NodePortAddresses)
				}
				if len(o.ConfigWarnings) != 0 {
					t.Errorf("warnings: %v", o.ConfigWarnings)
				}
			},
		},
		{
			name: "flags on the command line override the file", content: full,
			args: []string{"--hostname-override=node-b", "--iptables-sync-period=1m", "--oom-score-adj=0", "--nodeport-addresses=172.16.0.0/12"},
			check: func(t *testing.T, o *Options) {
				if o.HostnameOverride != "node-b" || o.SyncPeriod != time.Minute || o.OOMScoreAdj != 0 || strings.Join(o.NodePortAddresses, ",") != "172.16.0.0/12" {
					t.Errorf("flags did not win: %q %v %d %v", o.HostnameOverride, o.SyncPeriod, o.OOMScoreAdj, o.NodePortAddresses)
				}
				if o.BindAddress != "10.0.0.1" || o.MinSyncPeriod != 2*time.Second {
					t.Errorf("unflagged fields not from the file: %q %v", o.BindAddress, o.MinSyncPeriod)
				}
			},
		},
		{
			name: "unset fields keep the defaults", content: header + "hostnameOverride: node-n\n",
			check: func(t *testing.T, o *Options) {
				d := NewOptions()
				if o.SyncPeriod != d.SyncPeriod || o.OOMScoreAdj != d.OOMScoreAdj || o.HealthzBindAddress != d.HealthzBindAddress || o.BindAddress != d.BindAddress {
					t.Errorf("defaults changed: %+v", o)
				}
			},
		},
		{
			name: "oomScoreAdj 0 in the file is a value, not unset", content: header + "oomScoreAdj: 0\n",
			check: func(t *testing.T, o *Options) {
				if o.OOMScoreAdj != 0 {
					t.Errorf("OOMScoreAdj = %d, want 0", o.OOMScoreAdj)
				}
			},
		},
		{
			name: "iptables.localhostNodePorts false is used, not warned about", content: header + "iptables:\n  localhostNodePorts: false\n",
			check: func(t *testing.T, o *Options) {
				if o.LocalhostNodePorts || len(o.ConfigWarnings) != 0 {
					t.Errorf("LocalhostNodePorts = %v, warnings %q; want false, none", o.LocalhostNodePorts, o.ConfigWarnings)
				}
			},
		},
		{
			name: "iptables.localhostNodePorts unset: true, as kube-proxy's default", content: header + "iptables:\n  syncPeriod: 1m\n",
			check: func(t *testing.T, o *Options) {
				if !o.LocalhostNodePorts {
					t.Error("LocalhostNodePorts = false, want the default true")
				}
			},
		},
		{
			name: "--iptables-localhost-nodeports overrides the file", content: header + "iptables:\n  localhostNodePorts: false\n",
			args: []string{"--iptables-localhost-nodeports=true"},
			check: func(t *testing.T, o *Options) {
				if !o.LocalhostNodePorts {
					t.Error("LocalhostNodePorts = false, want the flag's true")
				}
			},
		},
		{
			name: "ignored fields are warned about", content: header + "ipvs:\n  scheduler: rr\ndetectLocalMode: InterfaceNamePrefix\n",
			check: func(t *testing.T, o *Options) {
				w := strings.Join(o.ConfigWarnings, "\n")
				if !strings.Contains(w, "ipvs") || !strings.Contains(w, "detectLocalMode") {
					t.Errorf("warnings = %q", w)
				}
			},
		},
		{
			name: "conntrack is used", content: header + `
conntrack:
  maxPerCore: 0
  min: 1000
  tcpEstablishedTimeout: 2h
  tcpCloseWaitTimeout: 30m
  tcpBeLiberal: true
  udpTimeout: 45s
  udpStreamTimeout: 3m
`,
			check: func(t *testing.T, o *Options) {
				if len(o.ConfigWarnings) != 0 {
					t.Errorf("warnings: %q", o.ConfigWarnings)
				}
				got := o.conntrackSettings(4)
				want := conntrackSettings{TCPEstablishedTimeout: 2 * time.Hour, TCPCloseWaitTimeout: 30 * time.Minute,
					TCPBeLiberal: true, UDPTimeout: 45 * time.Second, UDPStreamTimeout: 3 * time.Minute}
				if got != want || o.ConntrackMin != 1000 {
					t.Errorf("conntrack settings %+v (min %d), want %+v (min 1000)", got, o.ConntrackMin, want)
				}
			},
		},
		{
			name:    "an all-null conntrack section (kubeadm's) leaves every sysctl alone",
			content: header + "conntrack:\n  maxPerCore: null\n  min: null\n  tcpCloseWaitTimeout: null\n  tcpEstablishedTimeout: null\n",
			check: func(t *testing.T, o *Options) {
				if s := o.conntrackSettings(4); s != (conntrackSettings{}) || len(o.ConfigWarnings) != 0 {
					t.Errorf("settings %+v, warnings %q", s, o.ConfigWarnings)
				}
			},
		},
		{
			name: "clusterCIDR is used", content: header + "clusterCIDR: 10.244.0.0/16,fd00:244::/48\ndetectLocalMode: ClusterCIDR\n",
			check: func(t *testing.T, o *Options) {
				if o.ClusterCIDR != "10.244.0.0/16,fd00:244::/48" || len(o.ConfigWarnings) != 0 {
					t.Errorf("ClusterCIDR = %q, warnings %q", o.ClusterCIDR, o.ConfigWarnings)
				}
				v, err := o.Validate()
				if err != nil {
					t.Fatal(err)
				}
				if len(v.ClusterCIDRs) != 2 {
					t.Errorf("validated cluster CIDRs %v", v.ClusterCIDRs)
				}
			},
		},
		{name: "unknown field", content: header + "hostnameOverride: node-n\nfrobnicate: true\n", wantErr: `unknown field "frobnicate"`},
		{name: "unknown nested field", content: header + "iptables:\n  syncPeriodd: 1s\n", wantErr: `unknown field "iptables.syncPeriodd"`},
		{name: "duplicate field", content: header + "bindAddress: 1.2.3.4\nbindAddress: 1.2.3.5\n", wantErr: `bindAddress`},
		{name: "other mode", content: header + "mode: iptables\n", wantErr: `mode: "iptables"`},
		{name: "wrong kind", content: "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n", wantErr: "KubeletConfiguration"},
		{name: "no apiVersion", content: "kind: KubeProxyConfiguration\n", wantErr: "decode KubeProxyConfiguration"},
		{name: "bad duration", content: header + "iptables:\n  syncPeriod: soon\n", wantErr: `iptables.syncPeriod: time: invalid duration "soon"`},
		{name: "bad conntrack duration", content: header + "hostnameOverride: n\nconntrack:\n  min: 5\n  tcpCloseWaitTimeout: 1x\n", wantErr: "conntrack.tcpCloseWaitTimeout: "},
		{name: "bad integer", content: header + "conntrack:\n  maxPerCore: lots\n", wantErr: "maxPerCore"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := writeFile(t, tt.content)
			o, err := parse(t, append([]string{"--config", p}, tt.args...)...)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error = %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, o)
		})
	}
}

func equalOptions(a, b Options) bool {
	return a.Kubeconfig == b.Kubeconfig && a.HostnameOverride == b.HostnameOverride && a.BindAddress == b.BindAddress &&
		a.HealthzBindAddress == b.HealthzBindAddress && a.MetricsBindAddress == b.MetricsBindAddress &&
		a.SyncPeriod == b.SyncPeriod && a.MinSyncPeriod == b.MinSyncPeriod && a.OOMScoreAdj == b.OOMScoreAdj &&
		a.ProxyPortRange == b.ProxyPortRange && a.ClusterCIDR == b.ClusterCIDR
}

// TestValidateNamesConfigField: a bad value from the file is reported with the flag and the
// file's field; the same value from a flag names only the flag.
func TestValidateNamesConfigField(t *testing.T) {
	tests := []struct {
		name    string
		content string
		args    []string
		want    string
	}{
		{name: "bindAddress from file", content: header + "bindAddress: not-an-ip\n", want: "field bindAddress"},
		{name: "portRange from file", content: header + "portRange: 10-5\n", want: "field portRange"},
		{name: "oomScoreAdj from file", content: header + "oomScoreAdj: 2000\n", want: "field oomScoreAdj"},
		{name: "nodePortAddresses primary", content: header + "nodePortAddresses: [primary]\n", want: "field nodePortAddresses"},
		{name: "minSyncPeriod above syncPeriod", content: header + "iptables:\n  syncPeriod: 1s\n  minSyncPeriod: 5s\n", want: "field iptables.syncPeriod"},
		{name: "flag overrides with a bad value", content: header + "bindAddress: 10.0.0.1\n", args: []string{"--bind-address=nope"}, want: "--bind-address: \"nope\""},
		{name: "bad oom flag", content: header, args: []string{"--oom-score-adj=-1001"}, want: "--oom-score-adj: -1001"},
		{name: "clusterCIDR from file", content: header + "clusterCIDR: 10.244.0.0\n", want: "field clusterCIDR"},
		{name: "two IPv4 cluster CIDRs", content: header, args: []string{"--cluster-cidr=10.244.0.0/16,10.245.0.0/16"}, want: "--cluster-cidr: \"10.244.0.0/16,10.245.0.0/16\": at most one CIDR per IP family"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := writeFile(t, tt.content)
			o, err := parse(t, append([]string{"--config", p, "--hostname-override=n"}, tt.args...)...)
			if err != nil {
				t.Fatal(err)
			}
			_, err = o.Validate()
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate error = %v, want one containing %q", err, tt.want)
			}
		})
	}
}

// operationalFlags are the flags that are not settings, which --write-config-to leaves out.
var operationalFlags = map[string]bool{"config": true, "write-config-to": true, "cleanup": true, "conntrack-only": true, "version": true, "probe-ready": true}

// TestWriteConfigRoundTrip: what --write-config-to writes decodes strictly and, read back with
// --config plus the flags it lists in its comment, gives the same value of every setting, with
// no warning. Every flag is set to a value other than its default, so a setting that
// --write-config-to forgets fails here; a new flag fails until it is given a value below.
func TestWriteConfigRoundTrip(t *testing.T) {
	every := map[string]string{
		"kubeconfig": "/k", "master": "https://10.0.0.1:6443", "manifests": t.TempDir(), "service-cluster-ip-range": "10.100.0.0/16",
		"hostname-override": "node-x", "bind-address": "10.1.2.3", "nodeport-addresses": "10.0.0.0/8,192.168.0.0/16",
		"cluster-cidr": "10.244.0.0/16,fd00:244::/48", "portal-mode": "none", "proxy-port-range": "40000+100", "udp-timeout": "5s",
		"iptables-sync-period": "42s", "iptables-min-sync-period": "3s", "transparent-local": "false", "iptables-localhost-nodeports": "false",
		"conntrack-max-per-core": "1000", "conntrack-min": "5000", "conntrack-tcp-timeout-established": "2h0m0s",
		"conntrack-tcp-timeout-close-wait": "30m0s", "conntrack-tcp-be-liberal": "true", "conntrack-udp-timeout": "45s",
		"conntrack-udp-timeout-stream": "3m0s", "healthz-bind-address": "127.0.0.1:20256", "metrics-bind-address": "0.0.0.0:20249",
		"shutdown-grace-period": "7s", "oom-score-adj": "-10", "log-level": "debug",
		"fd-reserve": "100", "max-connections-per-port": "-1", "max-udp-sessions-per-port": "50", "tcp-idle-timeout": "1h0m0s", "max-affinity-entries-per-port": "500",
		"handover-socket": "/tmp/kup-test-handover.sock", "holder-socket": "/tmp/kup-test-holder/holder.sock", "handover-exit": "false", "profiling": "true",
		"ready-file": "/tmp/kup-test.ready",
	}
	tests := []struct {
		name string
		set  map[string]string
		// complete: set gives every setting a value other than its default.
		complete bool
	}{
		{name: "every setting changed", set: every, complete: true},
		{name: "servers disabled", set: map[string]string{"healthz-bind-address": "", "metrics-bind-address": ""}},
		{name: "defaults", set: map[string]string{}},
		{name: "conntrack limits explicitly left alone", set: map[string]string{"conntrack-max-per-core": "0", "conntrack-tcp-timeout-established": "0s"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var args []string
			for k, v := range tt.set {
				args = append(args, "--"+k+"="+v)
			}
			o, fs, err := parseFlags(t, args...)
			if err != nil {
				t.Fatal(err)
			}
			if tt.complete {
				fs.VisitAll(func(f *pflag.Flag) {
					if operationalFlags[f.Name] || f.Deprecated != "" { // deprecated: no setting to write
						return
					}
					if _, ok := tt.set[f.Name]; !ok {
						t.Errorf("--%s has no value in this test: give it one other than its default", f.Name)
					} else if f.Value.String() == f.DefValue {
						t.Errorf("--%s=%s is its default: give it another value", f.Name, f.Value)
					}
				})
			}
			var buf bytes.Buffer
			if err := o.WriteConfig(&buf); err != nil {
				t.Fatal(err)
			}
			out := buf.String()
			for _, want := range []string{"mode: userspace", "kind: KubeProxyConfiguration"} {
				if !strings.Contains(out, want) {
					t.Errorf("written config lacks %q:\n%s", want, out)
				}
			}
			// Read it back as an operator would: the file, plus the flags its comment lists.
			backArgs := []string{"--config", writeFile(t, out)}
			for _, line := range strings.Split(out, "\n") {
				if f, ok := strings.CutPrefix(line, "#   --"); ok {
					backArgs = append(backArgs, "--"+f)
				}
			}
			back, backFS, err := parseFlags(t, backArgs...)
			if err != nil {
				t.Fatalf("reading back:\n%s\n%v", out, err)
			}
			if len(back.ConfigWarnings) != 0 {
				t.Errorf("reading back warns: %q\n%s", back.ConfigWarnings, out)
			}
			fs.VisitAll(func(f *pflag.Flag) {
				if operationalFlags[f.Name] {
					return
				}
				if got := backFS.Lookup(f.Name).Value.String(); got != f.Value.String() {
					t.Errorf("--%s read back as %q, want %q", f.Name, got, f.Value)
				}
			})
			if t.Failed() {
				t.Logf("written:\n%s", out)
			}
		})
	}
}

func TestHelpGroups(t *testing.T) {
	o := NewOptions()
	fs := pflag.NewFlagSet("kube-userspace-proxy", pflag.ContinueOnError)
	var buf bytes.Buffer
	fs.SetOutput(&buf)
	o.AddFlags(fs)
	if err := fs.Parse([]string{"--help"}); err != pflag.ErrHelp {
		t.Fatalf("Parse(--help) = %v", err)
	}
	out := buf.String()
	prev := -1
	for _, g := range o.FlagGroups() {
		i := strings.Index(out, "\n"+g.Name+":\n")
		if i < 0 || i < prev {
			t.Fatalf("section %q missing or out of order in:\n%s", g.Name, out)
		}
		prev = i
	}
	// Every registered flag is printed exactly once, but deprecated ones, which are not.
	fs.VisitAll(func(f *pflag.Flag) {
		want := 1
		if f.Deprecated != "" {
			want = 0
		}
		if n := len(regexp.MustCompile(`(?m)^\s+--`+f.Name+`( \w+)?\s{2,}`).FindAllString(out, -1)); n != want {
			t.Errorf("--%s printed %d times, want %d", f.Name, n, want)
		}
	})
}
