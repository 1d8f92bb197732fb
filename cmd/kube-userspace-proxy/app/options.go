package app

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/portalloc"
)

// Portal modes.
const (
	PortalModeIPTables = "iptables"
	PortalModeNone     = "none"
)

// Options holds every setting of the proxy. Flags are named as kube-proxy names them wherever the
// setting exists there.
type Options struct {
	// Source.
	Kubeconfig string
	Master     string
	Manifests  string

	// Node.
	HostnameOverride  string
	BindAddress       string
	NodePortAddresses []string

	// Proxy.
	PortalMode            string
	ProxyPortRange        string
	UDPTimeout            time.Duration
	SyncPeriod            time.Duration
	MinSyncPeriod         time.Duration
	ServiceClusterIPRange string
	ShutdownGracePeriod   time.Duration

	// Servers.
	HealthzBindAddress string
	MetricsBindAddress string

	// Operation.
	Cleanup  bool
	LogLevel string
	Version  bool
}

// DefaultUDPTimeout is the idle timeout of UDP sessions. kube-proxy's 250ms broke DNS forwarders,
// which routinely wait longer than that for an upstream answer (the session vanished and the late
// reply was dropped); 30s is conntrack's own UDP timeout, so a session lives as long as the
// kernel would keep the same flow.
const DefaultUDPTimeout = 30 * time.Second

// NewOptions returns the defaults.
func NewOptions() *Options {
	return &Options{
		BindAddress:           "0.0.0.0",
		PortalMode:            PortalModeIPTables,
		UDPTimeout:            DefaultUDPTimeout,
		SyncPeriod:            30 * time.Second,
		MinSyncPeriod:         time.Second,
		ServiceClusterIPRange: "10.96.0.0/16",
		ShutdownGracePeriod:   30 * time.Second,
		HealthzBindAddress:    "0.0.0.0:10256",
		MetricsBindAddress:    "127.0.0.1:10249",
		LogLevel:              "info",
	}
}

// AddFlags registers the options' flags on fs.
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.Kubeconfig, "kubeconfig", o.Kubeconfig, "Path to a kubeconfig file. With neither --kubeconfig, --master nor --manifests, the in-cluster configuration is used.")
	fs.StringVar(&o.Master, "master", o.Master, "The address of the Kubernetes API server (overrides any value in kubeconfig).")
	fs.StringVar(&o.Manifests, "manifests", o.Manifests, "Serve the Services and EndpointSlices in this directory of *.yaml/*.yml/*.json manifests instead of an API server; changes are picked up while running.")

	fs.StringVar(&o.HostnameOverride, "hostname-override", o.HostnameOverride, "The name of this node (for endpoints' nodeName and Local traffic policies); default: the hostname.")
	fs.StringVar(&o.BindAddress, "bind-address", o.BindAddress, "The IP address the proxy listeners bind to (0.0.0.0 or :: for all addresses of both families).")
	fs.StringSliceVar(&o.NodePortAddresses, "nodeport-addresses", o.NodePortAddresses, "CIDRs of the node addresses that serve NodePorts (comma-separated); empty means all local addresses.")

	fs.StringVar(&o.PortalMode, "portal-mode", o.PortalMode, "How service traffic reaches the proxy: 'iptables' (portal rules, needs root/NET_ADMIN) or 'none' (only the listeners; no rules, no root).")
	fs.StringVar(&o.ProxyPortRange, "proxy-port-range", o.ProxyPortRange, "Range of host ports for the proxy listeners: 'begin-end', 'begin+offset' or a single port; empty means random ports.")
	fs.DurationVar(&o.UDPTimeout, "udp-timeout", o.UDPTimeout, "How long an idle UDP session is kept (kube-proxy's 250ms broke DNS forwarders; default: conntrack's 30s).")
	fs.DurationVar(&o.SyncPeriod, "iptables-sync-period", o.SyncPeriod, "The longest time between two syncs (rules repaired, state re-applied).")
	fs.DurationVar(&o.MinSyncPeriod, "iptables-min-sync-period", o.MinSyncPeriod, "The shortest time between two syncs; changes within it are applied together.")
	fs.StringVar(&o.ServiceClusterIPRange, "service-cluster-ip-range", o.ServiceClusterIPRange, "With --manifests: CIDR(s) (comma-separated, one per family) to allocate ClusterIPs from for services that set none.")
	fs.DurationVar(&o.ShutdownGracePeriod, "shutdown-grace-period", o.ShutdownGracePeriod, "On SIGTERM/SIGINT, how long established connections may continue before they are cut.")

	fs.StringVar(&o.HealthzBindAddress, "healthz-bind-address", o.HealthzBindAddress, "IP:port of the /healthz and /livez server; empty disables it.")
	fs.StringVar(&o.MetricsBindAddress, "metrics-bind-address", o.MetricsBindAddress, "IP:port of the Prometheus /metrics server; empty disables it.")

	fs.BoolVar(&o.Cleanup, "cleanup", o.Cleanup, "Remove every rule and chain this proxy owns, then exit.")
	fs.StringVar(&o.LogLevel, "log-level", o.LogLevel, "Log level: debug, info, warn or error.")
	fs.BoolVar(&o.Version, "version", o.Version, "Print the version and exit.")
}

// Validated is the parsed form of Options.
type Validated struct {
	BindAddress       netip.Addr
	NodePortAddresses []netip.Prefix
	PortRange         portalloc.Range
	ServiceCIDRs      []netip.Prefix
	NodeName          string
}

// Validate checks every option and returns their parsed form; each error names its flag.
func (o *Options) Validate() (*Validated, error) {
	var errs []error
	bad := func(flag, format string, args ...any) {
		errs = append(errs, fmt.Errorf("--%s: %s", flag, fmt.Sprintf(format, args...)))
	}
	v := &Validated{}
	var err error
	if v.BindAddress, err = netip.ParseAddr(o.BindAddress); err != nil {
		bad("bind-address", "%q is not an IP address", o.BindAddress)
	}
	for _, s := range o.NodePortAddresses {
		p, err := netip.ParsePrefix(strings.TrimSpace(s))
		if err != nil {
			bad("nodeport-addresses", "%q is not a CIDR", s)
			continue
		}
		v.NodePortAddresses = append(v.NodePortAddresses, p.Masked())
	}
	if v.PortRange, err = portalloc.ParseRange(o.ProxyPortRange); err != nil {
		bad("proxy-port-range", "%v", err)
	}
	for _, s := range strings.Split(o.ServiceClusterIPRange, ",") {
		p, err := netip.ParsePrefix(strings.TrimSpace(s))
		if err != nil {
			bad("service-cluster-ip-range", "%q is not a CIDR", s)
			continue
		}
		v.ServiceCIDRs = append(v.ServiceCIDRs, p.Masked())
	}
	if len(v.ServiceCIDRs) > 2 || (len(v.ServiceCIDRs) == 2 && v.ServiceCIDRs[0].Addr().Is4() == v.ServiceCIDRs[1].Addr().Is4()) {
		bad("service-cluster-ip-range", "%q: at most one CIDR per IP family", o.ServiceClusterIPRange)
	}
	switch o.PortalMode {
	case PortalModeIPTables, PortalModeNone:
	default:
		bad("portal-mode", "%q: want %q or %q", o.PortalMode, PortalModeIPTables, PortalModeNone)
	}
	if o.UDPTimeout <= 0 {
		bad("udp-timeout", "%v: must be positive", o.UDPTimeout)
	}
	if o.MinSyncPeriod < 0 {
		bad("iptables-min-sync-period", "%v: must not be negative", o.MinSyncPeriod)
	}
	if o.SyncPeriod <= 0 {
		bad("iptables-sync-period", "%v: must be positive", o.SyncPeriod)
	} else if o.SyncPeriod < o.MinSyncPeriod {
		bad("iptables-sync-period", "%v is shorter than --iptables-min-sync-period %v", o.SyncPeriod, o.MinSyncPeriod)
	}
	if o.ShutdownGracePeriod < 0 {
		bad("shutdown-grace-period", "%v: must not be negative", o.ShutdownGracePeriod)
	}
	for flag, s := range map[string]string{"healthz-bind-address": o.HealthzBindAddress, "metrics-bind-address": o.MetricsBindAddress} {
		if s == "" {
			continue
		}
		if _, err := netip.ParseAddrPort(s); err != nil {
			bad(flag, "%q is not IP:port", s)
		}
	}
	if o.Manifests != "" && (o.Kubeconfig != "" || o.Master != "") {
		bad("manifests", "cannot be combined with --kubeconfig or --master")
	}
	if o.Manifests != "" {
		if st, err := os.Stat(o.Manifests); err != nil || !st.IsDir() {
			bad("manifests", "%q is not a readable directory", o.Manifests)
		}
	}
	if _, err := parseLevel(o.LogLevel); err != nil {
		bad("log-level", "%v", err)
	}
	v.NodeName = strings.ToLower(strings.TrimSpace(o.HostnameOverride))
	if v.NodeName == "" {
		h, err := os.Hostname()
		if err != nil {
			bad("hostname-override", "empty, and the hostname is unknown: %v", err)
		}
		v.NodeName = strings.ToLower(h)
	}
	return v, errors.Join(errs...)
}
