package app

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	kpconfig "k8s.io/kube-proxy/config/v1alpha1"
	"sigs.k8s.io/yaml"
)

// ProxyModeUserspace is the only KubeProxyConfiguration mode this proxy implements; an empty
// mode means the same.
const ProxyModeUserspace = "userspace"

// configField maps a flag to the KubeProxyConfiguration field that sets the same thing.
type configField struct {
	flag  string
	field string // JSON path in the configuration file
	// set copies the field's value from cfg into o; it reports false when the field is unset
	// (its zero value), in which case the flag keeps its value.
	set func(o *Options, cfg *kpconfig.KubeProxyConfiguration) bool
	// get copies the option into cfg (for --write-config-to).
	get func(o *Options, cfg *kpconfig.KubeProxyConfiguration)
}

// configFields lists every setting that exists both as one of our flags and as a
// KubeProxyConfiguration field.
var configFields = []configField{
	valueField("kubeconfig", "clientConnection.kubeconfig",
		func(c *kpconfig.KubeProxyConfiguration) *string { return &c.ClientConnection.Kubeconfig },
		func(o *Options) *string { return &o.Kubeconfig }, same[string], same[string]),
	valueField("hostname-override", "hostnameOverride",
		func(c *kpconfig.KubeProxyConfiguration) *string { return &c.HostnameOverride },
		func(o *Options) *string { return &o.HostnameOverride }, same[string], same[string]),
	valueField("bind-address", "bindAddress",
		func(c *kpconfig.KubeProxyConfiguration) *string { return &c.BindAddress },
		func(o *Options) *string { return &o.BindAddress }, same[string], same[string]),
	valueField("healthz-bind-address", "healthzBindAddress",
		func(c *kpconfig.KubeProxyConfiguration) *string { return &c.HealthzBindAddress },
		func(o *Options) *string { return &o.HealthzBindAddress }, same[string], same[string]),
	valueField("metrics-bind-address", "metricsBindAddress",
		func(c *kpconfig.KubeProxyConfiguration) *string { return &c.MetricsBindAddress },
		func(o *Options) *string { return &o.MetricsBindAddress }, same[string], same[string]),
	{"nodeport-addresses", "nodePortAddresses",
		func(o *Options, c *kpconfig.KubeProxyConfiguration) bool {
			o.NodePortAddresses = append([]string(nil), c.NodePortAddresses...)
			return len(c.NodePortAddresses) > 0
		},
		func(o *Options, c *kpconfig.KubeProxyConfiguration) {
			c.NodePortAddresses = append([]string(nil), o.NodePortAddresses...)
		}},
	valueField("cluster-cidr", "clusterCIDR",
		func(c *kpconfig.KubeProxyConfiguration) *string { return &c.ClusterCIDR },
		func(o *Options) *string { return &o.ClusterCIDR }, same[string], same[string]),
	valueField("iptables-sync-period", "iptables.syncPeriod",
		func(c *kpconfig.KubeProxyConfiguration) *metav1.Duration { return &c.IPTables.SyncPeriod },
		func(o *Options) *time.Duration { return &o.SyncPeriod }, fromDuration, toDuration),
	pointerField("iptables-localhost-nodeports", "iptables.localhostNodePorts",
		func(c *kpconfig.KubeProxyConfiguration) **bool { return &c.IPTables.LocalhostNodePorts },
		func(o *Options) *bool { return &o.LocalhostNodePorts }, same[bool], same[bool]),
	valueField("iptables-min-sync-period", "iptables.minSyncPeriod",
		func(c *kpconfig.KubeProxyConfiguration) *metav1.Duration { return &c.IPTables.MinSyncPeriod },
		func(o *Options) *time.Duration { return &o.MinSyncPeriod }, fromDuration, toDuration),
	pointerField("oom-score-adj", "oomScoreAdj",
		func(c *kpconfig.KubeProxyConfiguration) **int32 { return &c.OOMScoreAdj },
		func(o *Options) *int32 { return &o.OOMScoreAdj }, same[int32], same[int32]),
	valueField("proxy-port-range", "portRange",
		func(c *kpconfig.KubeProxyConfiguration) *string { return &c.PortRange },
		func(o *Options) *string { return &o.ProxyPortRange }, same[string], same[string]),
	pointerField("conntrack-max-per-core", "conntrack.maxPerCore",
		func(c *kpconfig.KubeProxyConfiguration) **int32 { return &c.Conntrack.MaxPerCore },
		func(o *Options) *int32 { return &o.ConntrackMaxPerCore }, same[int32], same[int32]),
	pointerField("conntrack-min", "conntrack.min",
		func(c *kpconfig.KubeProxyConfiguration) **int32 { return &c.Conntrack.Min },
		func(o *Options) *int32 { return &o.ConntrackMin }, same[int32], same[int32]),
	pointerField("conntrack-tcp-timeout-established", "conntrack.tcpEstablishedTimeout",
		func(c *kpconfig.KubeProxyConfiguration) **metav1.Duration { return &c.Conntrack.TCPEstablishedTimeout },
		func(o *Options) *time.Duration { return &o.ConntrackTCPEstablishedTimeout }, fromDuration, toDuration),
	pointerField("conntrack-tcp-timeout-close-wait", "conntrack.tcpCloseWaitTimeout",
		func(c *kpconfig.KubeProxyConfiguration) **metav1.Duration { return &c.Conntrack.TCPCloseWaitTimeout },
		func(o *Options) *time.Duration { return &o.ConntrackTCPCloseWaitTimeout }, fromDuration, toDuration),
	valueField("profiling", "enableProfiling",
		func(c *kpconfig.KubeProxyConfiguration) *bool { return &c.EnableProfiling },
		func(o *Options) *bool { return &o.Profiling }, same[bool], same[bool]),
	valueField("conntrack-tcp-be-liberal", "conntrack.tcpBeLiberal",
		func(c *kpconfig.KubeProxyConfiguration) *bool { return &c.Conntrack.TCPBeLiberal },
		func(o *Options) *bool { return &o.ConntrackTCPBeLiberal }, same[bool], same[bool]),
	valueField("conntrack-udp-timeout", "conntrack.udpTimeout",
		func(c *kpconfig.KubeProxyConfiguration) *metav1.Duration { return &c.Conntrack.UDPTimeout },
		func(o *Options) *time.Duration { return &o.ConntrackUDPTimeout }, fromDuration, toDuration),
	valueField("conntrack-udp-timeout-stream", "conntrack.udpStreamTimeout",
		func(c *kpconfig.KubeProxyConfiguration) *metav1.Duration { return &c.Conntrack.UDPStreamTimeout },
		func(o *Options) *time.Duration { return &o.ConntrackUDPStreamTimeout }, fromDuration, toDuration),
}

// valueField is the configField of a flag whose configuration field is a value whose zero value
// means unset; toOpt and toFile convert the value between the file's type and the option's.
func valueField[F, O comparable](flag, field string, ptr func(*kpconfig.KubeProxyConfiguration) *F, opt func(*Options) *O,
	toOpt func(F) O, toFile func(O) F) configField {
	return configField{flag: flag, field: field,
		set: func(o *Options, c *kpconfig.KubeProxyConfiguration) bool {
			v := toOpt(*ptr(c))
			*opt(o) = v
			var zero O
			return v != zero
		},
		get: func(o *Options, c *kpconfig.KubeProxyConfiguration) { *ptr(c) = toFile(*opt(o)) },
	}
}

// pointerField is the configField of a flag whose configuration field is a pointer (nil: unset);
// toOpt and toFile convert the value between the file's type and the option's.
func pointerField[F, O any](flag, field string, ptr func(*kpconfig.KubeProxyConfiguration) **F, opt func(*Options) *O,
	toOpt func(F) O, toFile func(O) F) configField {
	return configField{flag: flag, field: field,
		set: func(o *Options, c *kpconfig.KubeProxyConfiguration) bool {
			p := *ptr(c)
			if p == nil {
				return false
			}
			*opt(o) = toOpt(*p)
			return true
		},
		get: func(o *Options, c *kpconfig.KubeProxyConfiguration) {
			v := toFile(*opt(o))
			*ptr(c) = &v
		}}
}

func same[T any](v T) T                            { return v }
func fromDuration(d metav1.Duration) time.Duration { return d.Duration }
func toDuration(d time.Duration) metav1.Duration   { return metav1.Duration{Duration: d} }

// LoadConfigFile reads a KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1, YAML or
// JSON) from path, strictly: an unknown or duplicate field is an error that names it.
func LoadConfigFile(path string) (*kpconfig.KubeProxyConfiguration, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config file: %w", err)
	}
	cfg, err := DecodeConfig(data)
	if err != nil {
		return nil, fmt.Errorf("config file %s: %w", path, err)
	}
	return cfg, nil
}

// DecodeConfig decodes a KubeProxyConfiguration strictly (unknown and duplicate fields are
// errors); apiVersion and kind must be kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration.
func DecodeConfig(data []byte) (*kpconfig.KubeProxyConfiguration, error) {
	scheme := runtime.NewScheme()
	if err := kpconfig.AddToScheme(scheme); err != nil {
		return nil, fmt.Errorf("register KubeProxyConfiguration types: %w", err)
	}
	codecs := serializer.NewCodecFactory(scheme, serializer.EnableStrict)
	// No default kind or object: the file must say what it is.
	decode := func(data []byte) (runtime.Object, *schema.GroupVersionKind, error) {
		return codecs.UniversalDeserializer().Decode(data, nil, nil)
	}
	obj, gvk, err := decode(data)
	if err != nil {
		if field := badField(data, decode); field != "" && !strings.Contains(err.Error(), field) {
			return nil, fmt.Errorf("decode KubeProxyConfiguration: %s: %w", field, err)
		}
		return nil, fmt.Errorf("decode KubeProxyConfiguration: %w", err)
	}
	cfg, ok := obj.(*kpconfig.KubeProxyConfiguration)
	if !ok {
		return nil, fmt.Errorf("decode KubeProxyConfiguration: got %v, want %s KubeProxyConfiguration", gvk, kpconfig.SchemeGroupVersion)
	}
	return cfg, nil
}

// badField returns the path (such as "iptables.syncPeriod") of the field of a configuration that
// decode rejects, for errors that do not name it (a malformed duration says only
// `time: invalid duration "banana"`), or "" when it cannot tell. It decodes, for each field in
// turn, a document with only that field (and apiVersion and kind), descending into the objects
// that fail.
func badField(data []byte, decode func([]byte) (runtime.Object, *schema.GroupVersionKind, error)) string {
	var doc map[string]any
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return ""
	}
	head := map[string]any{"apiVersion": doc["apiVersion"], "kind": doc["kind"]}
	fails := func(path []string, v any) bool {
		d := maps.Clone(head)
		inner := d
		for _, k := range path[:len(path)-1] {
			m := map[string]any{}
			inner[k] = m
			inner = m
		}
		inner[path[len(path)-1]] = v
		b, err := json.Marshal(d)
		if err != nil {
			return false
		}
		_, _, err = decode(b)
		return err != nil
	}
	if fails([]string{"kind"}, doc["kind"]) {
		return "" // the document as such is rejected: no one field is to blame
	}
	var find func(path []string, m map[string]any) string
	find = func(path []string, m map[string]any) string {
		for _, k := range slices.Sorted(maps.Keys(m)) {
			if len(path) == 0 && (k == "apiVersion" || k == "kind") {
				continue
			}
			p := append(slices.Clone(path), k)
			if !fails(p, m[k]) {
				continue
			}
			if sub, ok := m[k].(map[string]any); ok {
				if f := find(p, sub); f != "" {
					return f
				}
			}
			return strings.Join(p, ".")
		}
		return ""
	}
	return find(nil, doc)
}

// ApplyConfig sets the options from cfg, except those whose flag changed reports as set on the
// command line (flags override the file). It fails when cfg asks for another proxy mode, and
// returns a warning for each set field that has no effect here.
func (o *Options) ApplyConfig(cfg *kpconfig.KubeProxyConfiguration, changed func(flag string) bool) (warnings []string, err error) {
	if m := string(cfg.Mode); m != "" && m != ProxyModeUserspace {
		return nil, fmt.Errorf("mode: %q: kube-userspace-proxy implements only %q (or leave it empty)", m, ProxyModeUserspace)
	}
	if o.fromConfig == nil {
		o.fromConfig = map[string]string{}
	}
	for _, f := range configFields {
		if changed(f.flag) {
			continue
		}
		saved := *o
		if f.set(o, cfg) {
			o.fromConfig[f.flag] = f.field
		} else {
			*o = saved
		}
	}
	return ignoredFields(cfg), nil
}

// ignoredFields names the fields of cfg that are set but mean nothing to this proxy.
func ignoredFields(cfg *kpconfig.KubeProxyConfiguration) []string {
	var out []string
	note := func(set bool, field, why string) {
		if set {
			out = append(out, fmt.Sprintf("%s is ignored: %s", field, why))
		}
	}
	// A section is unset when it encodes as its zero value does: comparing the structs themselves
	// would see a decoded "0" quantity (logging's infoBufferSize, which --write-config-to writes)
	// as set.
	notSet := func(v any) bool {
		got, err1 := json.Marshal(v)
		zero, err2 := json.Marshal(reflect.Zero(reflect.TypeOf(v)).Interface())
		return err1 == nil && err2 == nil && bytes.Equal(got, zero)
	}
	cc := cfg.ClientConnection
	note(cc.QPS != 0 || cc.Burst != 0 || cc.ContentType != "" || cc.AcceptContentTypes != "",
		"clientConnection (other than kubeconfig)", "the client's rate limits and content types are built in")
	note(len(cfg.FeatureGates) > 0, "featureGates", "there are no feature gates")
	note(!notSet(cfg.Logging), "logging", "use --log-level")
	note(!notSet(cfg.IPVS), "ipvs", "only the userspace mode is implemented")
	note(!notSet(cfg.NFTables), "nftables", "only the userspace mode is implemented")
	note(!notSet(cfg.Winkernel), "winkernel", "only the userspace mode is implemented")
	note(cfg.IPTables.MasqueradeAll || cfg.IPTables.MasqueradeBit != nil,
		"iptables.masqueradeAll/masqueradeBit", "the userspace proxy needs no masquerading (it originates every connection)")
	note(cfg.DetectLocalMode != "" && cfg.DetectLocalMode != "ClusterCIDR" || !notSet(cfg.DetectLocal),
		"detectLocalMode/detectLocal", "pods are told apart by clusterCIDR only")
	note(cfg.ConfigSyncPeriod.Duration != 0, "configSyncPeriod", "informers do not resync")
	note(cfg.BindAddressHardFail || cfg.ShowHiddenMetricsForVersion != "",
		"bindAddressHardFail/showHiddenMetricsForVersion", "not implemented")
	return out
}

// Complete loads --config (when given) into o, letting flags set on fs's command line override
// it. Call it after fs.Parse and before Validate.
func (o *Options) Complete(fs *pflag.FlagSet) error {
	if o.ConfigFile == "" {
		return nil
	}
	cfg, err := LoadConfigFile(o.ConfigFile)
	if err != nil {
		return err
	}
	changed := func(name string) bool {
		f := fs.Lookup(name)
		return f != nil && f.Changed
	}
	warnings, err := o.ApplyConfig(cfg, changed)
	if err != nil {
		return fmt.Errorf("config file %s: %w", o.ConfigFile, err)
	}
	o.ConfigWarnings = warnings
	return nil
}

// KubeProxyConfiguration returns the effective settings as a KubeProxyConfiguration (mode
// userspace); settings of ours that have no field there are left out (see OwnFlags).
func (o *Options) KubeProxyConfiguration() *kpconfig.KubeProxyConfiguration {
	cfg := &kpconfig.KubeProxyConfiguration{
		TypeMeta: metav1.TypeMeta{APIVersion: kpconfig.SchemeGroupVersion.String(), Kind: "KubeProxyConfiguration"},
		Mode:     ProxyModeUserspace,
	}
	for _, f := range configFields {
		f.get(o, cfg)
	}
	return cfg
}

// OwnFlags returns our settings that have no KubeProxyConfiguration field, or a value the file
// cannot express (an empty server address, which disables the server), as command-line flags,
// sorted by name.
func (o *Options) OwnFlags() []string {
	own := map[string]string{
		"portal-mode":           o.PortalMode,
		"udp-timeout":           o.UDPTimeout.String(),
		"shutdown-grace-period": o.ShutdownGracePeriod.String(),
		"log-level":             o.LogLevel,
		"transparent-local":     strconv.FormatBool(o.TransparentLocal),
	}
	for flag, v := range map[string]int{"fd-reserve": o.FDReserve, "max-connections-per-port": o.MaxConnectionsPerPort,
		"max-udp-sessions-per-port": o.MaxUDPSessionsPerPort, "max-affinity-entries-per-port": o.MaxAffinityEntries} {
		if v != 0 {
			own[flag] = strconv.Itoa(v)
		}
	}
	if o.TCPIdleTimeout != 0 {
		own["tcp-idle-timeout"] = o.TCPIdleTimeout.String()
	}
	if !o.HandoverExit {
		own["handover-exit"] = "false"
	}
	if o.HandoverSocket != "" {
		own["handover-socket"] = o.HandoverSocket
	}
	if o.HolderSocket != "" {
		own["holder-socket"] = o.HolderSocket
	}
	if o.ReadyFile != "" {
		own["ready-file"] = o.ReadyFile
	}
	if o.Master != "" {
		own["master"] = o.Master
	}
	// An empty server address disables the server, but an empty field in the file means "the
	// default": say it with the flag.
	if o.HealthzBindAddress == "" {
		own["healthz-bind-address"] = ""
	}
	if o.MetricsBindAddress == "" {
		own["metrics-bind-address"] = ""
	}
	if o.Manifests != "" {
		own["manifests"] = o.Manifests
		own["service-cluster-ip-range"] = o.ServiceClusterIPRange
	}
	var out []string
	for k, v := range own {
		out = append(out, fmt.Sprintf("--%s=%s", k, v))
	}
	sort.Strings(out)
	return out
}

// WriteConfig writes the effective configuration as KubeProxyConfiguration YAML to w, preceded
// by a comment listing our own settings (which the file cannot carry) as flags.
func (o *Options) WriteConfig(w io.Writer) error {
	data, err := yaml.Marshal(o.KubeProxyConfiguration())
	if err != nil {
		return fmt.Errorf("encode KubeProxyConfiguration: %w", err)
	}
	var b strings.Builder
	b.WriteString("# Effective configuration of kube-userspace-proxy, written " + time.Now().UTC().Format(time.RFC3339) + ".\n")
	b.WriteString("# Settings without a KubeProxyConfiguration field (pass them as flags):\n")
	for _, f := range o.OwnFlags() {
		b.WriteString("#   " + f + "\n")
	}
	b.Write(data)
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("write configuration: %w", err)
	}
	return nil
}

// WriteConfigFile writes the effective configuration to path ("-" is standard output).
func (o *Options) WriteConfigFile(path string, stdout io.Writer) (err error) {
	if path == "-" {
		return o.WriteConfig(stdout)
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("write configuration: %w", err)
	}
	defer func() { err = errors.Join(err, f.Close()) }()
	return o.WriteConfig(f)
}
