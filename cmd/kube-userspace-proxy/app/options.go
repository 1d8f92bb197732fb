package app

import (
	"errors"
	"fmt"
	"io"
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
	ClusterCIDR       string

	// Proxy.
	PortalMode            string
	ProxyPortRange        string
	UDPTimeout            time.Duration
	SyncPeriod            time.Duration
	MinSyncPeriod         time.Duration
	ServiceClusterIPRange string
	ShutdownGracePeriod   time.Duration
	// HandoverSocket is where a running proxy hands everything over to its successor: "" for
	// this network namespace's socket in InstanceLockDir, HandoverNone for no hand-over.
	HandoverSocket string
	// HandoverExit: a proxy that handed everything over exits at once; false waits for
	// SIGTERM, serving nothing (in a pod, an exit would make the kubelet restart the container,
	// which would take everything back).
	HandoverExit bool
	// HolderSocket is the listener store's socket: a holder process there keeps duplicates of
	// the proxy's listening sockets, so that they outlive a crash ("" for none).
	HolderSocket string
	// LocalhostNodePorts: the node's own traffic to a NodePort on 127.0.0.1 (any 127.0.0.0/8
	// address) is served, as kube-proxy's iptables.localhostNodePorts; IPv6's ::1 never is.
	// Unserved, it meets the socket the proxy holds on [::]:NodePort (refused, or dropped).
	LocalhostNodePorts bool
	// TransparentLocal: external traffic of externalTrafficPolicy: Local services reaches
	// endpoints on this node from the client's own address (needs --portal-mode iptables).
	TransparentLocal bool

	// Conntrack sysctls: each is left alone while zero (false), unlike kube-proxy, whose
	// defaults set them (see conntrack.go).
	ConntrackMaxPerCore            int32
	ConntrackMin                   int32 // the least nf_conntrack_max, with ConntrackMaxPerCore
	ConntrackTCPEstablishedTimeout time.Duration
	ConntrackTCPCloseWaitTimeout   time.Duration
	ConntrackTCPBeLiberal          bool
	ConntrackUDPTimeout            time.Duration
	ConntrackUDPStreamTimeout      time.Duration

	// Limits of the data path (see userspace.Limits): 0 means the default, -1 no bound.
	FDReserve             int
	MaxConnectionsPerPort int
	MaxUDPSessionsPerPort int
	MaxAffinityEntries    int
	TCPIdleTimeout        time.Duration
	// TCPDataPath and TCPParkIdleAfter are deprecated flags' values, without effect: TCP is
	// relayed on event loops only. TCPDataPath may be empty or "loop"; Validate rejects
	// "goroutine", the removed data path, whose TCPParkIdleAfter is accepted and ignored.
	TCPDataPath      string
	TCPParkIdleAfter time.Duration

	// Servers.
	HealthzBindAddress string
	MetricsBindAddress string
	// Profiling serves Go's profiles (net/http/pprof) under /debug/pprof/ on the metrics server.
	Profiling bool

	// Operation.
	ConfigFile    string
	WriteConfigTo string
	OOMScoreAdj   int32
	Cleanup       bool
	// ConntrackOnly sets the conntrack sysctls, then exits (a privileged init container's job).
	ConntrackOnly bool
	LogLevel      string
	Version       bool
	// ReadyFile names this process while it serves the node ("": no file); ProbeReady checks
	// it and /healthz, and exits (see probe.go).
	ReadyFile  string
	ProbeReady bool

	// ConfigWarnings are set by Complete: fields of the configuration file that have no
	// effect here. Run logs them.
	ConfigWarnings []string
	// fromConfig maps the flags whose value came from the configuration file to the file's
	// field, so that Validate names the field the operator wrote.
	fromConfig map[string]string
}

// DefaultOOMScoreAdj is kube-proxy's: the proxy is among the last processes the OOM killer picks.
const DefaultOOMScoreAdj = -999

// DefaultUDPTimeout is the idle timeout of UDP sessions. kube-proxy's 250ms broke DNS forwarders,
// which routinely wait longer than that for an upstream answer (the session vanished and the late
// reply was dropped); 30s is conntrack's own UDP timeout, so a session lives as long as the
// kernel would keep the same flow.
const DefaultUDPTimeout = 30 * time.Second

// DefaultConntrackMin is kube-proxy's --conntrack-min. It matters only with
// --conntrack-max-per-core, which is unset (0, leave nf_conntrack_max alone) by default.
const DefaultConntrackMin = 131072

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
		HandoverExit:          true,
		HealthzBindAddress:    "0.0.0.0:10256",
		MetricsBindAddress:    "127.0.0.1:10249",
		LogLevel:              "info",
		OOMScoreAdj:           DefaultOOMScoreAdj,
		TransparentLocal:      true,
		LocalhostNodePorts:    true,
		ConntrackMin:          DefaultConntrackMin,
	}
}

// FlagGroup is a named group of flags, printed as one section of --help.
type FlagGroup struct {
	Name  string
	Flags *pflag.FlagSet
}

// FlagGroups returns the options' flags in the groups --help prints them in.
func (o *Options) FlagGroups() []FlagGroup {
	group := func(name string, add func(fs *pflag.FlagSet)) FlagGroup {
		fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
		add(fs)
		return FlagGroup{Name: name, Flags: fs}
	}
	return []FlagGroup{
		group("Configuration", func(fs *pflag.FlagSet) {
			fs.StringVar(&o.ConfigFile, "config", o.ConfigFile, "Path to a KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1, YAML or JSON; mode must be empty or 'userspace'). Flags given on the command line override it.")
			fs.StringVar(&o.WriteConfigTo, "write-config-to", o.WriteConfigTo, "Write the effective configuration as a KubeProxyConfiguration to this file ('-': standard output) and exit.")
		}),
		group("Source of Services and EndpointSlices", func(fs *pflag.FlagSet) {
			fs.StringVar(&o.Kubeconfig, "kubeconfig", o.Kubeconfig, "Path to a kubeconfig file. With neither --kubeconfig, --master nor --manifests, the in-cluster configuration is used. [config: clientConnection.kubeconfig]")
			fs.StringVar(&o.Master, "master", o.Master, "The address of the Kubernetes API server (overrides any value in kubeconfig).")
			fs.StringVar(&o.Manifests, "manifests", o.Manifests, "Serve the Services and EndpointSlices in this directory of *.yaml/*.yml/*.json manifests instead of an API server; changes are picked up while running.")
			fs.StringVar(&o.ServiceClusterIPRange, "service-cluster-ip-range", o.ServiceClusterIPRange, "With --manifests: CIDR(s) (comma-separated, one per family) to allocate ClusterIPs from for services that set none.")
		}),
		group("Node", func(fs *pflag.FlagSet) {
			fs.StringVar(&o.HostnameOverride, "hostname-override", o.HostnameOverride, "The name of this node (for endpoints' nodeName and Local traffic policies); default: the hostname. [config: hostnameOverride]")
			fs.StringVar(&o.BindAddress, "bind-address", o.BindAddress, "The IP address the proxy listeners bind to (0.0.0.0 or :: for all addresses of both families). [config: bindAddress]")
			fs.StringSliceVar(&o.NodePortAddresses, "nodeport-addresses", o.NodePortAddresses, "CIDRs of the node addresses that serve NodePorts (comma-separated); empty means all local addresses. [config: nodePortAddresses]")
			fs.StringVar(&o.ClusterCIDR, "cluster-cidr", o.ClusterCIDR, "The pods' CIDR(s) (comma-separated, one per family). Pods reaching a NodePort, externalIP or load-balancer IP of an externalTrafficPolicy: Local service are then served by any endpoint, as in kube-proxy, instead of being dropped on nodes without a local endpoint. [config: clusterCIDR]")
		}),
		group("Proxy", func(fs *pflag.FlagSet) {
			fs.StringVar(&o.PortalMode, "portal-mode", o.PortalMode, "How service traffic reaches the proxy: 'iptables' (portal rules, needs root/NET_ADMIN) or 'none' (only the listeners; no rules, no root).")
			fs.StringVar(&o.ProxyPortRange, "proxy-port-range", o.ProxyPortRange, "Range of host ports for the proxy listeners: 'begin-end', 'begin+offset' or a single port; empty means random ports. [config: portRange]")
			fs.DurationVar(&o.UDPTimeout, "udp-timeout", o.UDPTimeout, "How long an idle UDP session is kept (kube-proxy's 250ms broke DNS forwarders; default: conntrack's 30s).")
			fs.DurationVar(&o.SyncPeriod, "iptables-sync-period", o.SyncPeriod, "The longest time between two syncs (rules repaired, state re-applied). [config: iptables.syncPeriod]")
			fs.DurationVar(&o.MinSyncPeriod, "iptables-min-sync-period", o.MinSyncPeriod, "The shortest average time between two syncs (two may run back to back, as in kube-proxy); changes within it are applied together. [config: iptables.minSyncPeriod]")
			fs.BoolVar(&o.LocalhostNodePorts, "iptables-localhost-nodeports", o.LocalhostNodePorts, "Serve NodePorts on 127.0.0.1 (all of 127.0.0.0/8) to the node's own clients, as kube-proxy's iptables mode does; false leaves them unredirected: they meet the socket the proxy holds on the NodePort of every address, so TCP connections are refused and UDP datagrams dropped unread (no other process can bind the port there). IPv6's ::1 never serves NodePorts: the same happens there. [config: iptables.localhostNodePorts]")
			fs.BoolVar(&o.TransparentLocal, "transparent-local", o.TransparentLocal, "Keep the client's address for externalTrafficPolicy: Local services: connect to endpoints on this node from the client's own IP (IP_TRANSPARENT, with a mangle rule, ip rule and route that deliver the replies; needs --portal-mode iptables). false: endpoints see the node's address.")
		}),
		group("Conntrack (sysctls left alone unless set; kube-proxy's defaults set them)", func(fs *pflag.FlagSet) {
			fs.Int32Var(&o.ConntrackMaxPerCore, "conntrack-max-per-core", o.ConntrackMaxPerCore, "Set net.netfilter.nf_conntrack_max to this times the number of CPUs (or to --conntrack-min if that is larger), and grow the conntrack hash table to a quarter of it; only possible from the host's network namespace. 0: leave them alone (kube-proxy's default is 32768). [config: conntrack.maxPerCore]")
			fs.Int32Var(&o.ConntrackMin, "conntrack-min", o.ConntrackMin, "The least nf_conntrack_max that --conntrack-max-per-core sets. [config: conntrack.min]")
			fs.DurationVar(&o.ConntrackTCPEstablishedTimeout, "conntrack-tcp-timeout-established", o.ConntrackTCPEstablishedTimeout, "Set net.netfilter.nf_conntrack_tcp_timeout_established (whole seconds). 0: leave it alone (kube-proxy's default is 24h). [config: conntrack.tcpEstablishedTimeout]")
			fs.DurationVar(&o.ConntrackTCPCloseWaitTimeout, "conntrack-tcp-timeout-close-wait", o.ConntrackTCPCloseWaitTimeout, "Set net.netfilter.nf_conntrack_tcp_timeout_close_wait (whole seconds). 0: leave it alone (kube-proxy's default is 1h). [config: conntrack.tcpCloseWaitTimeout]")
			fs.BoolVar(&o.ConntrackTCPBeLiberal, "conntrack-tcp-be-liberal", o.ConntrackTCPBeLiberal, "Set net.netfilter.nf_conntrack_tcp_be_liberal to 1 (out-of-window TCP packets are not marked INVALID). false: leave it alone. [config: conntrack.tcpBeLiberal]")
			fs.DurationVar(&o.ConntrackUDPTimeout, "conntrack-udp-timeout", o.ConntrackUDPTimeout, "Set net.netfilter.nf_conntrack_udp_timeout (whole seconds). 0: leave it alone. [config: conntrack.udpTimeout]")
			fs.DurationVar(&o.ConntrackUDPStreamTimeout, "conntrack-udp-timeout-stream", o.ConntrackUDPStreamTimeout, "Set net.netfilter.nf_conntrack_udp_timeout_stream (whole seconds). 0: leave it alone. [config: conntrack.udpStreamTimeout]")
		}),
		group("Limits (a flood against one service must not reach another)", func(fs *pflag.FlagSet) {
			fs.IntVar(&o.FDReserve, "fd-reserve", o.FDReserve, "File descriptors below the open-files limit that the data path leaves to the proxy's control work (manifests, iptables-restore, conntrack, the API watch, the health servers). 0: a quarter of the limit, at most 256.")
			fs.IntVar(&o.MaxConnectionsPerPort, "max-connections-per-port", o.MaxConnectionsPerPort, "The most TCP connections one service port may have open; more are reset at once. 0: half of the data path's descriptor budget; -1: no bound but the budget.")
			fs.IntVar(&o.MaxUDPSessionsPerPort, "max-udp-sessions-per-port", o.MaxUDPSessionsPerPort, "The most UDP sessions (client addresses) one service port may have; a new client beyond it ends the port's longest-idle session. 0: half of the data path's descriptor budget; -1: no bound but the budget.")
			fs.IntVar(&o.MaxAffinityEntries, "max-affinity-entries-per-port", o.MaxAffinityEntries, "The most ClientIP session-affinity entries one service port keeps; beyond it the least recently used client is forgotten. 0: 10000.")
			fs.DurationVar(&o.TCPIdleTimeout, "tcp-idle-timeout", o.TCPIdleTimeout, "Reset proxied TCP connections that moved no byte either way for this long. 0: never (iptables mode's conntrack established timeout is 24h).")
			fs.StringVar(&o.TCPDataPath, "tcp-data-path", o.TCPDataPath, "Deprecated: TCP is relayed on event loops (loop), the only data path; goroutine was removed.")
			_ = fs.MarkDeprecated("tcp-data-path", "TCP is relayed on event loops, the only data path (loop, the former default); the flag has no effect and will be removed. --tcp-data-path=goroutine is refused: that data path was removed.")
			fs.DurationVar(&o.TCPParkIdleAfter, "tcp-park-idle-after", o.TCPParkIdleAfter, "Deprecated: applied to the removed goroutine data path only.")
			_ = fs.MarkDeprecated("tcp-park-idle-after", "it applied to the removed goroutine TCP data path only; it has no effect and will be removed.")
		}),
		group("Health and metrics", func(fs *pflag.FlagSet) {
			fs.StringVar(&o.HealthzBindAddress, "healthz-bind-address", o.HealthzBindAddress, "IP:port of the /healthz and /livez server; empty disables it. [config: healthzBindAddress]")
			fs.StringVar(&o.MetricsBindAddress, "metrics-bind-address", o.MetricsBindAddress, "IP:port of the Prometheus /metrics server; empty disables it. [config: metricsBindAddress]")
			fs.BoolVar(&o.Profiling, "profiling", o.Profiling, "Serve Go's CPU, heap and goroutine profiles under /debug/pprof/ on the metrics server (a CPU profile of at most 9s: the server's write timeout). [config: enableProfiling]")
		}),
		group("Process", func(fs *pflag.FlagSet) {
			fs.DurationVar(&o.ShutdownGracePeriod, "shutdown-grace-period", o.ShutdownGracePeriod, "On SIGTERM/SIGINT, how long established connections may continue before they are cut (a second signal exits at once).")
			fs.BoolVar(&o.HandoverExit, "handover-exit", o.HandoverExit, "Exit once everything is handed over to a successor. false: wait for SIGTERM, holding and serving nothing (for pods: an exit would make the kubelet restart the container, which would take everything back).")
			fs.StringVar(&o.HolderSocket, "holder-socket", o.HolderSocket, "Unix socket of a holder (kube-userspace-proxy hold) that keeps duplicates of the proxy's listening sockets, so that they outlive the proxy: after a crash, new connections wait in the kernel's queues and the next proxy serves them. The proxy tells the holder its listeners after each sync and takes them back at a start that is not a hand-over. Empty: no holder (Linux only).")
			fs.StringVar(&o.HandoverSocket, "handover-socket", o.HandoverSocket, "Unix socket through which a proxy started while another runs on the node takes over its listeners, connections, UDP sessions and affinity (nothing is dropped; the old one exits). Empty: /run/kube-userspace-proxy/handover-netns-<inode>.sock (Linux; elsewhere no hand-over); 'none': no hand-over (a second proxy exits).")
			fs.Int32Var(&o.OOMScoreAdj, "oom-score-adj", o.OOMScoreAdj, "The oom_score_adj of the process, in [-1000, 1000]; failing to set it is only a warning. [config: oomScoreAdj]")
			fs.StringVar(&o.LogLevel, "log-level", o.LogLevel, "Log level: debug, info, warn or error.")
			fs.BoolVar(&o.Cleanup, "cleanup", o.Cleanup, "Remove every rule and chain this proxy owns, then exit.")
			fs.BoolVar(&o.ConntrackOnly, "conntrack-only", o.ConntrackOnly, "Set the conntrack sysctls that the --conntrack-* flags or the configuration's conntrack section ask for, then exit (0 also when one could not be set: each is a warning, as at a proxy's start). For a privileged init container, so that the proxy itself runs without a writable /proc/sys; the proxy then finds them set.")
			fs.StringVar(&o.ReadyFile, "ready-file", o.ReadyFile, "While this process serves the node (from its first sync, holding the instance lock when it programs portals, until it hands over or stops), a file at this path names it (pid and start time), for --probe-ready. Give each proxy a path of its own (in a container: /tmp). Empty: no file.")
			fs.BoolVar(&o.ProbeReady, "probe-ready", o.ProbeReady, "Exit 0 if the process that --ready-file names is running and serves the node, and /healthz (at --healthz-bind-address; loopback for an unspecified address) answers 200; otherwise print why and exit 1. For an exec readinessProbe of a hostNetwork pod, whose httpGet probe the previous proxy on the node would answer during a rolling update.")
			fs.BoolVar(&o.Version, "version", o.Version, "Print the version and commit, and exit.")
		}),
	}
}

// AddFlags registers the options' flags on fs and makes fs's usage print them by group.
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	groups := o.FlagGroups()
	for _, g := range groups {
		fs.AddFlagSet(g.Flags)
	}
	fs.SortFlags = false
	fs.Usage = func() { PrintUsage(fs.Output(), fs.Name(), groups) }
}

// PrintUsage prints the command's usage with one section per flag group.
func PrintUsage(w io.Writer, name string, groups []FlagGroup) {
	fmt.Fprintf(w, "Usage: %s [flags]\n\n", name)
	fmt.Fprintf(w, "A Kubernetes service proxy in the manner of kube-proxy's userspace mode. Flags are named as\n")
	fmt.Fprintf(w, "kube-proxy names them; [config: F] marks those that a KubeProxyConfiguration (--config) also sets.\n")
	for _, g := range groups {
		g.Flags.SortFlags = false
		fmt.Fprintf(w, "\n%s:\n%s", g.Name, g.Flags.FlagUsagesWrapped(100))
	}
}

// Validated is the parsed form of Options.
type Validated struct {
	BindAddress       netip.Addr
	NodePortAddresses []netip.Prefix
	ClusterCIDRs      []netip.Prefix
	PortRange         portalloc.Range
	ServiceCIDRs      []netip.Prefix
	NodeName          string
}

// Validate checks every option and returns their parsed form; each error names its flag.
func (o *Options) Validate() (*Validated, error) {
	var errs []error
	bad := func(flag, format string, args ...any) {
		name := "--" + flag
		if field, ok := o.fromConfig[flag]; ok {
			name = fmt.Sprintf("%s (config file %s field %s)", name, o.ConfigFile, field)
		}
		errs = append(errs, fmt.Errorf("%s: %s", name, fmt.Sprintf(format, args...)))
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
	if o.ClusterCIDR != "" {
		v.ClusterCIDRs = dualStackCIDRs(o.ClusterCIDR, func(format string, args ...any) { bad("cluster-cidr", format, args...) })
	}
	if v.PortRange, err = portalloc.ParseRange(o.ProxyPortRange); err != nil {
		bad("proxy-port-range", "%v", err)
	}
	v.ServiceCIDRs = dualStackCIDRs(o.ServiceClusterIPRange, func(format string, args ...any) { bad("service-cluster-ip-range", format, args...) })
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
	if o.FDReserve < 0 {
		bad("fd-reserve", "%d: must not be negative", o.FDReserve)
	}
	if o.MaxAffinityEntries < 0 {
		bad("max-affinity-entries-per-port", "%d: must not be negative", o.MaxAffinityEntries)
	}
	for flag, n := range map[string]int{"max-connections-per-port": o.MaxConnectionsPerPort, "max-udp-sessions-per-port": o.MaxUDPSessionsPerPort} {
		if n < -1 {
			bad(flag, "%d: must be -1 (no bound), 0 (the default) or positive", n)
		}
	}
	switch o.TCPDataPath {
	case "", "loop":
	case "goroutine":
		bad("tcp-data-path", "%q: the goroutine TCP data path was removed; TCP is relayed on event loops (the former default, loop: the same behaviour at about two thirds of the CPU per connection, but one busy service port uses at most two cores); remove the flag", o.TCPDataPath)
	default:
		bad("tcp-data-path", "%q: the flag is deprecated; its only value is \"loop\"", o.TCPDataPath)
	}
	if o.TCPIdleTimeout < 0 {
		bad("tcp-idle-timeout", "%v: must not be negative", o.TCPIdleTimeout)
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
	if o.OOMScoreAdj < -1000 || o.OOMScoreAdj > 1000 {
		bad("oom-score-adj", "%d: must be in [-1000, 1000]", o.OOMScoreAdj)
	}
	if o.ConntrackMaxPerCore < 0 {
		bad("conntrack-max-per-core", "%d: must not be negative", o.ConntrackMaxPerCore)
	}
	if o.ConntrackMin < 0 {
		bad("conntrack-min", "%d: must not be negative", o.ConntrackMin)
	}
	for flag, d := range map[string]time.Duration{
		"conntrack-tcp-timeout-established": o.ConntrackTCPEstablishedTimeout,
		"conntrack-tcp-timeout-close-wait":  o.ConntrackTCPCloseWaitTimeout,
		"conntrack-udp-timeout":             o.ConntrackUDPTimeout,
		"conntrack-udp-timeout-stream":      o.ConntrackUDPStreamTimeout,
	} {
		if d < 0 || d > 0 && d < time.Second {
			bad(flag, "%v: must be 0 (leave the sysctl alone) or at least 1s", d)
		}
	}
	validateOS(o, bad)
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

// dualStackCIDRs parses a comma-separated list of at most one CIDR per IP family (masked),
// reporting what is wrong through bad.
func dualStackCIDRs(list string, bad func(format string, args ...any)) []netip.Prefix {
	var out []netip.Prefix
	for _, s := range strings.Split(list, ",") {
		p, err := netip.ParsePrefix(strings.TrimSpace(s))
		if err != nil {
			bad("%q is not a CIDR", s)
			continue
		}
		out = append(out, p.Masked())
	}
	if len(out) > 2 || (len(out) == 2 && out[0].Addr().Is4() == out[1].Addr().Is4()) {
		bad("%q: at most one CIDR per IP family", list)
	}
	return out
}
