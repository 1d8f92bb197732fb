//go:build linux && bench

package bench

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/cluster"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

func TestMain(m *testing.M) { os.Exit(harness.Main(m)) }

// Ports of the server pod (kup-echo TCP+UDP, iperf3 TCP+UDP) and of HAProxy's frontends.
const (
	echoPort     = 8080
	iperfPort    = 5201
	hapEchoPort  = 18080
	hapIperfPort = 15201
	metricsAddr  = "127.0.0.1:10249"
)

// settings are the sizes of one run; quick mode shrinks them.
type settings struct {
	reps          int
	iperfArgs     []string // how long iperf3 runs: -t N or -n BYTES
	loadDuration  time.Duration
	latRate       float64
	idleCounts    []int
	serviceScales []int
	probes        int // one-more-service probes per scale
	cpuWindow     time.Duration
	// steadyIdle makes the idle CPU window wait for kube-userspace-proxy's first periodic full
	// sync after the restart (up to a sync period), so that it measures the steady state.
	steadyIdle bool
	// handoverConns idle connections are held through kube-userspace-proxy while a successor
	// takes over from it, at the first of serviceScales ≥ handoverScale (the last if none is).
	handoverConns, handoverScale int
	// proxyLog is kube-userspace-proxy's --log-level; empty means info.
	proxyLog string
	// proxyArgs are more flags for kube-userspace-proxy (KUP_BENCH_PROXY_ARGS).
	proxyArgs []string
	// proxyWrapper runs it under env with KUP_BENCH_PROXY_ENV's variables; nil: none.
	proxyWrapper []string
}

// handoverAt returns the service scale at which the hand-over row is measured.
func (s settings) handoverAt() int {
	for _, n := range s.serviceScales {
		if n >= s.handoverScale {
			return n
		}
	}
	return s.serviceScales[len(s.serviceScales)-1]
}

func configure(quick bool) settings {
	if quick {
		return settings{reps: 1, iperfArgs: []string{"-n", "64M"}, loadDuration: 300 * time.Millisecond, latRate: 2000,
			idleCounts: []int{1000}, serviceScales: []int{100}, probes: 1, cpuWindow: 2 * time.Second,
			handoverConns: 1000, handoverScale: 1000}
	}
	return settings{reps: 3, iperfArgs: []string{"-t", "3"}, loadDuration: 2 * time.Second, latRate: 2000,
		idleCounts: []int{10000, 50000}, serviceScales: []int{100, 1000, 5000, 10000}, probes: 3, cpuWindow: 30 * time.Second, steadyIdle: true,
		handoverConns: 10000, handoverScale: 1000}
}

// onlyFromEnv applies the partial-run knobs to cfg: a partial run is for working on one figure,
// not for results (write it to KUP_BENCH_OUT). KUP_BENCH_ONLY picks the rows: controlplane (the
// control-plane rows, no hand-over), datapath (the data-path rows from a pod and the node, no
// outside clients), idle (the idle-connection rows) or none (with KUP_BENCH_HOLD); KUP_BENCH_SCALES=N,M the control plane's
// service counts, KUP_BENCH_IDLE=N,M the idle rows' connection counts; KUP_BENCH_PROXY_LOG=level
// kube-userspace-proxy's --log-level; KUP_BENCH_PROXY_ARGS more of its flags and
// KUP_BENCH_PROXY_ENV variables of its environment (space-separated, NAME=value: an A/B of one
// setting, such as GOMAXPROCS=1). It returns KUP_BENCH_ONLY.
func onlyFromEnv(cfg *settings) (string, error) {
	only := os.Getenv("KUP_BENCH_ONLY")
	switch only {
	case "", "controlplane", "datapath", "idle", "none", "churn":
	default:
		return "", fmt.Errorf("KUP_BENCH_ONLY=%q: the partial runs are controlplane, datapath, idle, churn (the endpoint churn rows) and none (with KUP_BENCH_HOLD)", only)
	}
	counts := func(name string) ([]int, error) {
		var ns []int
		for _, f := range strings.Split(os.Getenv(name), ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n <= 0 {
				return nil, fmt.Errorf("%s=%q: want counts like 1000,10000", name, os.Getenv(name))
			}
			ns = append(ns, n)
		}
		return ns, nil
	}
	var err error
	if os.Getenv("KUP_BENCH_SCALES") != "" {
		if cfg.serviceScales, err = counts("KUP_BENCH_SCALES"); err != nil {
			return "", err
		}
	}
	if os.Getenv("KUP_BENCH_IDLE") != "" {
		if cfg.idleCounts, err = counts("KUP_BENCH_IDLE"); err != nil {
			return "", err
		}
	}
	cfg.proxyLog = os.Getenv("KUP_BENCH_PROXY_LOG")
	cfg.proxyArgs = strings.Fields(os.Getenv("KUP_BENCH_PROXY_ARGS"))
	if env := strings.Fields(os.Getenv("KUP_BENCH_PROXY_ENV")); len(env) > 0 {
		cfg.proxyWrapper = append([]string{"env"}, env...)
	}
	return only, nil
}

// holdTopology is KUP_BENCH_HOLD=file: it writes, for each path, the client pod's and node's
// namespaces, the address to use and the proxy's process id to file, then waits until file is
// removed (or the test's deadline is near), so that one can measure a path by hand (`ip netns
// exec NS kup-load conn --addr ADDR`, `strace -c -f -p PID`, `perf record -p PID`) on the
// topology the figures come from. A development aid: the run then goes on as asked.
func holdTopology(t *testing.T, file string, targets map[string]target, loadBin string, pids map[string]int) {
	var b strings.Builder
	fmt.Fprintf(&b, "# remove this file to let the bench go on\nLOAD=%s\n", loadBin)
	for _, p := range Paths {
		tg := targets[p]
		fmt.Fprintf(&b, "path=%q pod=%s node=%s echo=%s iperf=%s pid=%d\n", p, tg.pod.NS.Name(), tg.node.NS.Name(), tg.echo, tg.iperf, pids[p])
	}
	if err := os.WriteFile(file, []byte(b.String()), 0o644); err != nil {
		t.Fatalf("KUP_BENCH_HOLD: %v", err)
	}
	t.Logf("KUP_BENCH_HOLD: topology held; %s describes it; remove it to go on", file)
	deadline, ok := t.Deadline()
	for {
		if _, err := os.Stat(file); errors.Is(err, os.ErrNotExist) {
			return
		}
		if ok && time.Until(deadline) < 5*time.Minute {
			t.Logf("KUP_BENCH_HOLD: the test's deadline is near; going on")
			return
		}
		time.Sleep(time.Second)
	}
}

// keepLog copies a process's log so far to name in the system's temporary directory (a
// KUP_BENCH_PROXY_LOG run's proxy log outlives the test's own temporary directory).
func keepLog(t *testing.T, p *netns.Process, name string) {
	b, err := os.ReadFile(p.LogPath())
	if err == nil {
		path := filepath.Join(os.TempDir(), name)
		err = os.WriteFile(path, b, 0o644)
		t.Logf("proxy log kept in %s", path)
	}
	if err != nil {
		t.Errorf("keep the proxy's log: %v", err)
	}
}

// target is one path as seen from one node: the client pod and node, and the addresses to use.
type target struct {
	path  string
	node  *netns.Node
	pod   *netns.Pod
	echo  string // TCP and UDP kup-echo
	iperf string // iperf3 TCP (and UDP)
	udp   bool   // whether the path proxies UDP
	pid   int    // the proxy's process (0: the path has none, the kernel does the work)
}

func (tg target) from(src string) *netns.NS {
	if src == "pod" {
		return tg.pod.NS
	}
	return tg.node.NS
}

func TestBench(t *testing.T) {
	quick := os.Getenv("BENCH_QUICK") != ""
	cfg := configure(quick)
	only, err := onlyFromEnv(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	rep := &Report{Started: time.Now(), Quick: quick, Reps: cfg.reps, LoadStart: loadavg(), Machine: machine(t)}
	outDir := os.Getenv("KUP_BENCH_OUT")
	if outDir == "" {
		outDir = "results"
	}
	if quick {
		outDir = filepath.Join(outDir, "quick")
	}
	if only == "churn" { // the endpoint churn rows have a topology and a table of their own
		runChurn(t, quick, outDir)
		return
	}
	defer func() { writeReport(t, rep, outDir, cfg.serviceScales[len(cfg.serviceScales)-1]) }()

	loadBin := filepath.Join(t.TempDir(), "kup-load")
	if out, err := exec.Command("go", "build", "-o", loadBin, "./cmd/kup-load").CombinedOutput(); err != nil {
		t.Fatalf("build kup-load: %v\n%s", err, out)
	}
	for _, tool := range []string{"iperf3", "haproxy"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is needed (make bench installs it): %v", tool, err)
		}
	}
	ctx := context.Background()

	// Topology: a control plane, a server node with the server pod, and one node per path, each
	// with a client pod. Each proxy runs in its own node namespace.
	n := netns.NewNetwork(t, "bench")
	c := cluster.Start(t, cluster.Options{Network: n})
	srvNode := n.AddNode(t, "srv")
	srv := n.AddPod(t, srvNode, "server")
	harness.StartEcho(t, srv.NS, "server", echoPort)
	srv.NS.Start(t, "iperf3", "-s", "-p", strconv.Itoa(iperfPort))
	nodes := map[string]*netns.Node{}
	pods := map[string]*netns.Pod{}
	nodeNames := map[string]string{PathDirect: "direct", PathIPTables: "ipt", PathKUP: "kup", PathHAProxy: "hap", PathHAProxyRedirect: "hapr"}
	for _, p := range Paths {
		nodes[p] = n.AddNode(t, nodeNames[p])
		pods[p] = n.AddPod(t, nodes[p], "client")
		// The load generator's own connects must not be the limit: with the default
		// tcp_tw_reuse=2 (loopback only), each connect searches past the client's earlier
		// connections in TIME_WAIT, which held iptables mode and direct to about half of what
		// they reach with 1 (measured on the held topology). The node namespaces, where the proxies
		// connect to the endpoint, keep the default.
		if out, err := pods[p].NS.Exec(ctx, "sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"); err != nil {
			t.Fatalf("client pod of %s: tcp_tw_reuse: %v: %s", p, err, out)
		}
		if _, err := c.CreateNode(ctx, nodeNames[p], nodes[p].IP); err != nil {
			t.Fatalf("create node %s: %v", nodeNames[p], err)
		}
	}
	if _, err := c.CreateNode(ctx, "srv", srvNode.IP); err != nil {
		t.Fatalf("create node srv: %v", err)
	}
	svc := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("bench",
		harness.TCPPort("echo", 80, echoPort), harness.UDPPort("echo-udp", 80, echoPort),
		harness.TCPPort("iperf", iperfPort, iperfPort), harness.UDPPort("iperf-udp", iperfPort, iperfPort)))
	srvEP := harness.Endpoint{IP: srv.IP, Node: "srv", Name: "server"}
	harness.ApplySlice(ctx, t, c.Client, harness.Slice(svc, srvEP))

	kp := c.KubeProxy(t, nodes[PathIPTables].NS, nodeNames[PathIPTables])
	kupCfg := harness.ProxyConfig{NodeName: nodeNames[PathKUP], Kubeconfig: c.Kubeconfig, MetricsBindAddress: metricsAddr, LogLevel: cmp.Or(cfg.proxyLog, "info"),
		// The idle-connection rows hold up to the open-files limit on one service port: the
		// per-port bound (half of the descriptor budget by default) would stop them halfway,
		// where HAProxy, which has no such bound, goes on.
		Args:    slices.Concat([]string{"--max-connections-per-port=-1"}, profilingArgs(cfg), cfg.proxyArgs),
		Wrapper: cfg.proxyWrapper,
		Ready: func(ctx context.Context) error {
			_, err := harness.Ask(ctx, nodes[PathKUP].NS, "tcp", harness.Addr(svc, 0))
			return err
		}}
	kup := harness.StartProxy(t, nodes[PathKUP].NS, kupCfg)
	hap := startHAProxy(t, nodes[PathHAProxy], srv.IP.String())
	hapr := startHAProxy(t, nodes[PathHAProxyRedirect], srv.IP.String())
	copyPortalRules(ctx, t, nodes[PathKUP], nodes[PathHAProxyRedirect])
	harness.WaitFor(t, 30*time.Second, func() error {
		_, err := harness.Ask(ctx, nodes[PathIPTables].NS, "tcp", harness.Addr(svc, 0))
		return err
	})

	hapIP := nodes[PathHAProxy].IP.String()
	targets := map[string]target{
		PathDirect:   {echo: fmt.Sprintf("%s:%d", srv.IP, echoPort), iperf: fmt.Sprintf("%s:%d", srv.IP, iperfPort), udp: true},
		PathIPTables: {echo: harness.Addr(svc, 0), iperf: harness.Addr(svc, 2), udp: true},
		PathKUP:      {echo: harness.Addr(svc, 0), iperf: harness.Addr(svc, 2), udp: true},
		PathHAProxy:  {echo: fmt.Sprintf("%s:%d", hapIP, hapEchoPort), iperf: fmt.Sprintf("%s:%d", hapIP, hapIperfPort)},
		// The ClusterIP, redirected to HAProxy by the copy of kube-userspace-proxy's rules.
		PathHAProxyRedirect: {echo: harness.Addr(svc, 0), iperf: harness.Addr(svc, 2)},
	}
	pids := map[string]int{PathKUP: kup.Pid(), PathHAProxy: hap.Pid(), PathHAProxyRedirect: hapr.Pid()}
	for p, tg := range targets {
		tg.path, tg.node, tg.pod, tg.pid = p, nodes[p], pods[p], pids[p]
		targets[p] = tg
	}
	// Every path answers from both sources before anything is measured.
	for _, p := range Paths {
		for _, src := range []string{"pod", "node"} {
			if _, err := harness.Ask(ctx, targets[p].from(src), "tcp", targets[p].echo); err != nil {
				t.Fatalf("path %s from %s: %v", p, src, err)
			}
		}
	}

	if hold := os.Getenv("KUP_BENCH_HOLD"); hold != "" {
		holdTopology(t, hold, targets, loadBin, pids)
	}

	// The outside-client paths (their proxies stop before the idle and control-plane
	// workloads, which they would otherwise load with every service created there).
	if only == "" {
		out := setupOutside(ctx, t, n, c, cfg.reps)
		runDataPath(t, rep, cfg, targets, loadBin)
		runOutside(t, rep, cfg, out, loadBin)
		for _, p := range OutsidePaths {
			out.paths[p].stop()
		}
	} else if only == "datapath" {
		runDataPath(t, rep, cfg, targets, loadBin)
	}
	if only == "" || only == "datapath" {
		for _, src := range []string{"pod", "node"} {
			rep.AddDifference(rep.Metric("keep-alive latency p99", src, "µs", false), "keep-alive latency p99 added (vs direct)", PathDirect)
		}
	}
	if only == "" || only == "idle" {
		runIdle(t, rep, cfg, targets, loadBin, pids)
	}
	if only == "" || only == "controlplane" {
		runControlPlane(t, rep, cfg, c, nodes, srvEP, kp, kup, kupCfg, func(kup *harness.Proxy, scale int) *harness.Proxy {
			if only != "" {
				return kup
			}
			return runHandover(t, rep, cfg, scale, targets[PathKUP], loadBin, kup, kupCfg)
		})
	}

	if only == "" {
		t.Run("endpoint churn", func(t *testing.T) { runChurn(t, quick, outDir) })
	}

	rep.Notes = append(rep.Notes,
		"Topology: real etcd + kube-apiserver (test/cluster), one network namespace per node and pod (test/netns); "+
			"server pod (kup-echo on 8080 TCP+UDP, iperf3 -s on 5201) on its own node; each path has its own node namespace with a client pod. "+
			"`from pod` = client in that node's pod; `from node` = client in the node namespace itself.",
		"Paths: direct = the server pod's IP; iptables = upstream kube-proxy v1.36.3 --proxy-mode=iptables on a ClusterIP; "+
			"kube-userspace-proxy on the same ClusterIP (its own node); haproxy = Debian HAProxy, mode tcp, option splice-auto, on its node's IP, pointing at the pod; its node namespace has no netfilter rules, so no conntrack. "+
			"haproxy redirect = the same HAProxy on a node of its own that holds a copy of kube-userspace-proxy's node rules (iptables-save from its node once it has synced, restored there) with the bench service's TCP portal rules pointed at HAProxy's ports, reached through the ClusterIP as kube-userspace-proxy is: a proxy in userspace mode's place, paying its netfilter work (REDIRECT and conntrack, the filter rules on new flows, the mangle rule of transparent sockets); not in the idle-connection rows.",
		"Client pods run with net.ipv4.tcp_tw_reuse=1, so that the load generator's connects do not search past its own TIME_WAIT sockets (with the default, iptables mode and direct reached about half the short-connection rate); node namespaces, where the proxies connect to the endpoint and the `from node` client runs, keep the default (2).",
		"HAProxy has no UDP proxying: its UDP cells are n/a. HAProxy runs with maxconn 9900 and maxpipes 40 so that its descriptors fit the 20000 limit.",
		"The machine is shared (2 cores, other test suites running: see the load averages), so tail latencies (p99, p99.9) are dominated by scheduling delays and vary widely between repetitions; the medians of throughput figures are steadier. Compare paths within a row, not against other machines.",
		fmt.Sprintf("Bulk figures are iperf3 (%s) receiver throughput; UDP bulk is iperf3 -u -b 0 -l 1400, delivered rate = sender rate × (1 − loss).", strings.Join(cfg.iperfArgs, " ")),
		fmt.Sprintf("Short connections: kup-load conn, 4 workers, one request per new TCP connection, %v. Latency: one keep-alive connection, %.0f req/s on a fixed schedule (latency counted from the scheduled send), %v. UDP req/resp: 4 connected sockets, 64-byte requests, %v, a lost datagram waits 200 ms.",
			cfg.loadDuration, cfg.latRate, cfg.loadDuration, cfg.loadDuration),
	)
	rep.LoadEnd = loadavg()
	rep.Finished = time.Now()
}

// runDataPath runs workloads 1–4: per repetition, per workload and source, every path in turn
// (the order rotates each repetition).
func runDataPath(t *testing.T, rep *Report, cfg settings, targets map[string]target, loadBin string) {
	secs := fmt.Sprint(cfg.loadDuration)
	for r := range cfg.reps {
		order := append(append([]string{}, Paths[r%len(Paths):]...), Paths[:r%len(Paths)]...)
		for _, src := range []string{"pod", "node"} {
			each := func(fn func(tg target, ns *netns.NS)) {
				for _, p := range order {
					fn(targets[p], targets[p].from(src))
				}
			}
			for _, streams := range []int{1, 4} {
				m := rep.Metric(fmt.Sprintf("bulk TCP, %d stream(s)", streams), src, "Gbit/s", true)
				each(func(tg target, ns *netns.NS) {
					v, err := iperf(ns, tg.iperf, streams, false, cfg.iperfArgs)
					record(t, m, tg.path, v/1e9, err)
				})
			}
			m := rep.Metric("short connections", src, "conn/s", true)
			shortCost := newProxyCost(rep, "short connection", src)
			each(func(tg target, ns *netns.NS) {
				before := usageOf(tg.pid)
				res, err := load(ns, loadBin, "conn", tg.echo, "--duration", secs, "--concurrency", "4", "--max", "200000")
				record(t, m, tg.path, res.Rate, err)
				shortCost.record(t, tg, before, res, err)
			})
			p50 := rep.Metric("keep-alive latency p50", src, "µs", false)
			p99 := rep.Metric("keep-alive latency p99", src, "µs", false)
			p999 := rep.Metric("keep-alive latency p99.9", src, "µs", false)
			latCost := newProxyCost(rep, "keep-alive request", src)
			each(func(tg target, ns *netns.NS) {
				before := usageOf(tg.pid)
				res, err := load(ns, loadBin, "lat", tg.echo, "--duration", secs, "--rate", fmt.Sprint(cfg.latRate))
				latCost.record(t, tg, before, res, err)
				record(t, p50, tg.path, res.P50us, err)
				record(t, p99, tg.path, res.P99us, err)
				record(t, p999, tg.path, res.P999us, err)
			})
			m = rep.Metric("UDP 64-byte req/resp", src, "req/s", true)
			udpCost := newProxyCost(rep, "UDP request", src)
			each(func(tg target, ns *netns.NS) {
				if !tg.udp {
					m.Note(tg.path, "n/a (no UDP)")
					udpCost.cpu.Note(tg.path, "n/a (no UDP)")
					udpCost.switches.Note(tg.path, "n/a (no UDP)")
					return
				}
				before := usageOf(tg.pid)
				res, err := load(ns, loadBin, "udprr", tg.echo, "--duration", secs, "--concurrency", "4", "--size", "64")
				record(t, m, tg.path, res.Rate, err)
				udpCost.record(t, tg, before, res, err)
			})
			m = rep.Metric("UDP bulk, 1400-byte datagrams", src, "Mbit/s", true)
			each(func(tg target, ns *netns.NS) {
				if !tg.udp {
					m.Note(tg.path, "n/a (no UDP)")
					return
				}
				v, err := iperf(ns, tg.iperf, 1, true, cfg.iperfArgs)
				record(t, m, tg.path, v/1e6, err)
			})
		}
		t.Logf("data path repetition %d/%d done (load %s)", r+1, cfg.reps, loadavg())
	}
}

// record adds v to m for path, or notes err (a failed measurement is reported, not fatal).
// usage is a process's CPU time (all its threads, from /proc/PID/task/*/schedstat, in ns) and
// context switches (voluntary and not, summed over its threads) at one moment.
type usage struct {
	cpu      time.Duration
	switches int64
	ok       bool
}

// usageOf reads pid's usage; not ok for pid 0 or a process that is gone. A thread that ends
// between two readings takes its share with it: the proxies measured keep their threads.
func usageOf(pid int) usage {
	if pid == 0 {
		return usage{}
	}
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*", pid))
	if err != nil || len(tasks) == 0 {
		return usage{}
	}
	u := usage{ok: true}
	for _, task := range tasks {
		if b, err := os.ReadFile(filepath.Join(task, "schedstat")); err == nil {
			if f := strings.Fields(string(b)); len(f) > 0 {
				ns, _ := strconv.ParseInt(f[0], 10, 64)
				u.cpu += time.Duration(ns)
			}
		}
		b, err := os.ReadFile(filepath.Join(task, "status"))
		if err != nil {
			continue // a thread that ended
		}
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "voluntary_ctxt_switches:"); ok {
				n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
				u.switches += n
			} else if v, ok := strings.CutPrefix(l, "nonvoluntary_ctxt_switches:"); ok {
				n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
				u.switches += n
			}
		}
	}
	return u
}

// proxyCost is the proxy's CPU time and context switches per operation of a workload: what a
// path costs the node besides its rate. The kernel paths (direct, iptables) have no process.
type proxyCost struct{ cpu, switches *Metric }

func newProxyCost(rep *Report, op, src string) proxyCost {
	return proxyCost{
		cpu:      rep.Metric("proxy CPU per "+op, src, "µs", false),
		switches: rep.Metric("proxy context switches per "+op, src, "switches", false),
	}
}

// record adds the cost per operation of one run of tg's workload that started at before.
func (pc proxyCost) record(t *testing.T, tg target, before usage, res loadResult, err error) {
	if tg.pid == 0 {
		pc.cpu.Note(tg.path, "n/a (kernel)")
		pc.switches.Note(tg.path, "n/a (kernel)")
		return
	}
	after := usageOf(tg.pid)
	if err == nil && (!before.ok || !after.ok || res.Ops == 0) {
		err = fmt.Errorf("no usage of process %d", tg.pid)
	}
	var cpu, sw float64
	if err == nil {
		cpu = float64((after.cpu-before.cpu)/time.Nanosecond) / 1e3 / float64(res.Ops)
		sw = float64(after.switches-before.switches) / float64(res.Ops)
	}
	record(t, pc.cpu, tg.path, cpu, err)
	record(t, pc.switches, tg.path, sw, err)
}

func record(t *testing.T, m *Metric, path string, v float64, err error) {
	if err != nil {
		t.Logf("%s (%s) via %s: %v", m.Workload, m.Source, path, err)
		m.Note(path, "error: "+firstLine(err.Error(), 80))
		return
	}
	m.Add(path, v)
}

func firstLine(s string, n int) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > n {
		s = s[:n] + "…"
	}
	return strings.ReplaceAll(s, "|", "/")
}

// iperf runs an iperf3 client in ns against addr and returns the receiver's bits per second
// (UDP: the sender's rate times the delivered fraction).
func iperf(ns *netns.NS, addr string, streams int, udp bool, length []string) (float64, error) {
	host, port, _ := strings.Cut(addr, ":")
	args := []string{"iperf3", "-c", host, "-p", port, "-J", "--connect-timeout", "3000", "-P", strconv.Itoa(streams)}
	args = append(args, length...)
	if udp {
		args = append(args, "-u", "-b", "0", "-l", "1400")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := ns.Exec(ctx, args...)
	var res struct {
		Error string `json:"error"`
		End   struct {
			SumReceived struct {
				BPS float64 `json:"bits_per_second"`
			} `json:"sum_received"`
			Sum struct {
				BPS  float64 `json:"bits_per_second"`
				Lost float64 `json:"lost_percent"`
			} `json:"sum"`
		} `json:"end"`
	}
	if jerr := json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &res); jerr != nil || res.Error != "" {
		return 0, fmt.Errorf("iperf3 %s: %v %v %s", addr, err, jerr, res.Error)
	}
	if udp {
		return res.End.Sum.BPS * (1 - res.End.Sum.Lost/100), nil
	}
	return res.End.SumReceived.BPS, nil
}

// loadResult is kup-load's output.
type loadResult struct {
	Ops, Errors          int64
	Rate                 float64
	P50us, P99us, P999us float64 `json:"-"`
	FirstErr             string  `json:"first_error"`
}

func load(ns *netns.NS, bin, mode, addr string, args ...string) (loadResult, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := ns.Exec(ctx, append([]string{bin, mode, "--addr", addr}, args...)...)
	var raw struct {
		Ops      int64   `json:"ops"`
		Errors   int64   `json:"errors"`
		Rate     float64 `json:"rate"`
		P50      float64 `json:"p50_us"`
		P99      float64 `json:"p99_us"`
		P999     float64 `json:"p999_us"`
		FirstErr string  `json:"first_error"`
	}
	i := strings.LastIndex(out, "{")
	if err != nil || i < 0 {
		return loadResult{}, fmt.Errorf("kup-load %s %s: %v: %s", mode, addr, err, out)
	}
	if err := json.Unmarshal([]byte(out[i:]), &raw); err != nil {
		return loadResult{}, fmt.Errorf("kup-load %s %s: %w: %s", mode, addr, err, out)
	}
	res := loadResult{Ops: raw.Ops, Errors: raw.Errors, Rate: raw.Rate, P50us: raw.P50, P99us: raw.P99, P999us: raw.P999, FirstErr: raw.FirstErr}
	if raw.Ops == 0 {
		return res, fmt.Errorf("kup-load %s %s: no successful request (%d errors, first: %s)", mode, addr, raw.Errors, raw.FirstErr)
	}
	if mode != "udprr" && raw.Errors > 0 {
		return res, fmt.Errorf("kup-load %s %s: %d errors (first: %s)", mode, addr, raw.Errors, raw.FirstErr)
	}
	return res, nil
}

// copyPortalRules gives node to the netfilter rules kube-userspace-proxy keeps on node from
// (iptables-save there, iptables-restore here), with the TCP portal rules of the bench service's
// echo and iperf ports pointed at HAProxy's frontends on to: REDIRECT --to-ports P becomes
// HAProxy's port, DNAT --to-destination fromIP:P becomes to's IP and HAProxy's port.
func copyPortalRules(ctx context.Context, t *testing.T, from, to *netns.Node) {
	t.Helper()
	saved, err := from.NS.Exec(ctx, "iptables-save")
	if err != nil {
		t.Fatalf("haproxy redirect: %v", err)
	}
	ports := map[string]int{`"default/bench:echo"`: hapEchoPort, `"default/bench:iperf"`: hapIperfPort}
	var b strings.Builder
	rewritten := 0
	for line := range strings.Lines(saved) {
		line = strings.TrimSuffix(line, "\n")
		for comment, port := range ports {
			if !strings.HasPrefix(line, "-A ") || !strings.Contains(line, " -p tcp ") || !strings.Contains(line, "--comment "+comment+" ") {
				continue
			}
			if i := strings.Index(line, "-j REDIRECT --to-ports "); i >= 0 {
				line = fmt.Sprintf("%s-j REDIRECT --to-ports %d", line[:i], port)
				rewritten++
			} else if i := strings.Index(line, "-j DNAT --to-destination "); i >= 0 {
				line = fmt.Sprintf("%s-j DNAT --to-destination %s:%d", line[:i], to.IP, port)
				rewritten++
			}
		}
		b.WriteString(line + "\n")
	}
	if rewritten != 4 { // echo and iperf, each in KUBE-PORTALS-CONTAINER and -HOST
		t.Fatalf("haproxy redirect: %d portal rules pointed at HAProxy, want 4; kube-userspace-proxy's rules:\n%s", rewritten, saved)
	}
	path := filepath.Join(t.TempDir(), "rules")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := to.NS.Exec(ctx, "iptables-restore", path); err != nil {
		t.Fatalf("haproxy redirect: %v", err)
	}
}

// startHAProxy runs HAProxy in node (tcp mode, splice) in front of the server pod.
func startHAProxy(t *testing.T, node *netns.Node, podIP string) *netns.Process {
	t.Helper()
	conf := fmt.Sprintf(`global
  maxconn 9900
  maxpipes 40
defaults
  mode tcp
  option splice-auto
  timeout connect 5s
  timeout client 1h
  timeout server 1h
listen echo
  bind :%d
  server pod %s:%d
listen iperf
  bind :%d
  server pod %s:%d
`, hapEchoPort, podIP, echoPort, hapIperfPort, podIP, iperfPort)
	path := filepath.Join(t.TempDir(), "haproxy.cfg")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	p := node.NS.Start(t, "haproxy", "-db", "-f", path)
	addr := fmt.Sprintf("%s:%d", node.IP, hapEchoPort)
	harness.WaitFor(t, 10*time.Second, func() error {
		select {
		case <-p.Done():
			t.Fatalf("haproxy exited: %v\n%s", p.Err(), p.Tail(20))
		default:
		}
		_, err := harness.Ask(context.Background(), node.NS, "tcp", addr)
		return err
	})
	return p
}

// runIdle is workload 5: N idle connections through each proxy, proxy RSS per connection.
func runIdle(t *testing.T, rep *Report, cfg settings, targets map[string]target, loadBin string, pids map[string]int) {
	conntrack := conntrackObjSize()
	// RSS before the first test: memory a proxy took for the first count is not returned to the
	// system, so later counts are measured against the same starting point.
	base := map[string]int64{}
	for _, p := range []string{PathKUP, PathHAProxy} {
		v, err := rssKiB(pids[p])
		if err != nil {
			t.Errorf("RSS of %s: %v", p, err)
		}
		base[p] = v
	}
	for _, count := range cfg.idleCounts {
		m := rep.Metric(fmt.Sprintf("%d idle connections: memory per connection", count), "pod", "KiB", false)
		later := rep.Metric(fmt.Sprintf("%d idle connections: memory per connection, 5 s later", count), "pod", "KiB", false)
		reached := rep.Metric(fmt.Sprintf("%d idle connections: connections reached", count), "pod", "conns", true)
		later.Note(PathDirect, "n/a (no proxy)")
		later.Note(PathIPTables, "as above")
		m.Note(PathDirect, "n/a (no proxy)")
		reached.Note(PathDirect, "n/a (no proxy)")
		if conntrack > 0 {
			m.Add(PathIPTables, float64(conntrack)/1024)
			m.Note(PathIPTables, "kernel: one conntrack entry (slab object), not process memory")
		} else {
			m.Note(PathIPTables, "n/a (kernel conntrack)")
		}
		reached.Note(PathIPTables, "n/a (kernel)")
		for _, p := range []string{PathKUP, PathHAProxy} {
			before := base[p]
			tg := targets[p]
			if p == PathKUP && cfg.proxyLog != "" {
				logMemory(t, tg.node.NS, pids[p], fmt.Sprintf("kup-bench-heap-before-idle-%d.pprof", count))
			}
			proc := tg.pod.NS.Start(t, loadBin, "idle", "--addr", tg.echo, "--count", strconv.Itoa(count), "--hold", "300s")
			got := -1
			deadline := time.Now().Add(180 * time.Second)
			for got < 0 && time.Now().Before(deadline) {
				if i := strings.Index(proc.Log(), "READY "); i >= 0 {
					fmt.Sscanf(proc.Log()[i:], "READY %d", &got)
				} else {
					time.Sleep(200 * time.Millisecond)
				}
			}
			time.Sleep(time.Second)
			after, err := rssKiB(pids[p])
			// Again once the connections have been idle for a while: memory the burst of
			// connecting took may be returned to the system by then.
			time.Sleep(5 * time.Second)
			afterIdle, errIdle := rssKiB(pids[p])
			if p == PathKUP && cfg.proxyLog != "" {
				logMemory(t, tg.node.NS, pids[p], fmt.Sprintf("kup-bench-heap-idle-%d.pprof", count))
			}
			log := proc.Log()
			proc.Stop()
			if err != nil || got <= 0 {
				m.Note(p, fmt.Sprintf("error: %v, reached %d: %s", err, got, firstLine(log, 80)))
				continue
			}
			m.Add(p, float64(after-before)/float64(got))
			if errIdle == nil {
				later.Add(p, float64(afterIdle-before)/float64(got))
			}
			reached.Add(p, float64(got))
			if got < count {
				note := fmt.Sprintf("reached %d of %d: %s", got, count, firstLine(strings.TrimSpace(log[strings.Index(log, "READY"):]), 60))
				m.Note(p, note)
				reached.Note(p, "fd limit")
				t.Logf("idle %d via %s: %s; log: %s", count, p, note, firstLine(log, 300))
			}
			time.Sleep(2 * time.Second) // let the proxy close its side
		}
	}
	rep.Notes = append(rep.Notes,
		"Idle connections: proxy RSS (VmRSS) while holding the connections (1 s after the last was made, and again 5 s later) minus its RSS before the first idle test, over the connections reached; each connection made one request first. "+
			"Kernel socket and pipe memory is not in RSS. The container's open-files limit is 20000 (hard, not raisable): a proxy needs two descriptors per connection, "+
			"so about 9,990 proxied connections is the most any userspace proxy can hold here, and 50,000 is impossible (the client alone would need 50,000 descriptors).")
}

// runControlPlane is workload 6. At the scale cfg.handoverAt it calls handover with the running
// kube-userspace-proxy, which returns the one running after it.
func runControlPlane(t *testing.T, rep *Report, cfg settings, c *cluster.Cluster, nodes map[string]*netns.Node, ep harness.Endpoint,
	kp *netns.Process, kup *harness.Proxy, kupCfg harness.ProxyConfig, handover func(kup *harness.Proxy, scale int) *harness.Proxy) {
	ctx := context.Background()
	created := 0
	var last *corev1.Service
	for _, scale := range cfg.serviceScales {
		start := time.Now()
		last = createServices(t, c, created, scale, ep)
		created = scale
		// Both proxies serve the last one before anything is measured.
		for _, p := range []string{PathIPTables, PathKUP} {
			harness.WaitFor(t, 300*time.Second, func() error {
				_, err := harness.AskTimeout(ctx, nodes[p].NS, "tcp", harness.Addr(last, 0), 500*time.Millisecond)
				return err
			})
		}
		t.Logf("%d services created and served in %v", scale, time.Since(start).Round(time.Millisecond))

		m := rep.Metric(fmt.Sprintf("one more service → first connection, %d services", scale), "node", "ms", false)
		m.Note(PathDirect, "n/a")
		m.Note(PathHAProxy, "n/a (static config)")
		for i := range cfg.probes {
			// A steady state first: neither proxy is still working off the previous change
			// (both allow two syncs in a row, then one per --iptables-min-sync-period).
			time.Sleep(2*time.Second + 100*time.Millisecond)
			svc := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService(fmt.Sprintf("probe-%d-%d", scale, i), harness.TCPPort("tcp", 80, echoPort)))
			t0 := time.Now()
			harness.ApplySlice(ctx, t, c.Client, harness.Slice(svc, ep))
			var wg sync.WaitGroup
			for _, p := range []string{PathIPTables, PathKUP} {
				wg.Go(func() {
					// t0 is taken after the Service exists (its ClusterIP is needed), before the slice.
					d, err := firstAnswer(ctx, nodes[p].NS, harness.Addr(svc, 0), t0)
					record(t, m, p, float64(d.Microseconds())/1e3, err)
				})
			}
			wg.Wait()
		}
		if cfg.proxyLog != "" {
			keepLog(t, kup.Process, fmt.Sprintf("kup-bench-proxy-%d.log", scale))
		}

		// A full resync: restart each proxy with every service present; its first sync is full.
		rs := rep.Metric(fmt.Sprintf("full sync after restart, %d services", scale), "", "ms", false)
		rs.Note(PathDirect, "n/a")
		rs.Note(PathHAProxy, "n/a")
		kp.Stop()
		kp = c.KubeProxy(t, nodes[PathIPTables].NS, "ipt")
		d, err := firstSync(nodes[PathIPTables].NS)
		record(t, rs, PathIPTables, d, err)
		kup.Stop()
		kup = harness.StartProxy(t, nodes[PathKUP].NS, kupCfg)
		harness.WaitFor(t, 60*time.Second, func() error {
			_, err := harness.AskTimeout(ctx, nodes[PathKUP].NS, "tcp", harness.Addr(last, 0), 500*time.Millisecond)
			return err
		})
		d, err = firstSync(nodes[PathKUP].NS)
		record(t, rs, PathKUP, d, err)
		if cfg.proxyLog != "" {
			keepLog(t, kup.Process, fmt.Sprintf("kup-bench-proxy-restart-%d.log", scale))
		}

		// Idle CPU of both, over the same window: in a full run, once kube-userspace-proxy has
		// made its first periodic full sync since the restart (which also checks every port's
		// endpoints against the new listeners' own addresses, a once-per-start cost). Upstream
		// kube-proxy makes no periodic full sync within the hour (its partial syncs find nothing
		// to do); it is idle in either window.
		if cfg.steadyIdle {
			if err := waitPeriodicFullSync(nodes[PathKUP].NS, 75*time.Second); err != nil {
				t.Logf("idle CPU at %d services: %v; measuring anyway", scale, err)
			}
		}
		time.Sleep(2 * time.Second)
		cpu := rep.Metric(fmt.Sprintf("idle CPU, %d services", scale), "", "% of a core", false)
		cpu.Note(PathDirect, "n/a")
		cpu.Note(PathHAProxy, "n/a")
		var wg sync.WaitGroup
		for p, pid := range map[string]int{PathIPTables: kp.Pid(), PathKUP: kup.Pid()} {
			wg.Go(func() {
				v, err := cpuPercent(pid, cfg.cpuWindow)
				record(t, cpu, p, v, err)
			})
		}
		wg.Wait()

		// Memory of both right after that window: each has served every service since its
		// restart, and has been idle for the window.
		mem := rep.Metric(fmt.Sprintf("RSS after restart, %d services", scale), "", "MiB", false)
		mem.Note(PathDirect, "n/a")
		mem.Note(PathHAProxy, "n/a")
		for p, pid := range map[string]int{PathIPTables: kp.Pid(), PathKUP: kup.Pid()} {
			kib, err := rssKiB(pid)
			record(t, mem, p, float64(kib)/1024, err)
		}
		if cfg.proxyLog != "" {
			logMemory(t, nodes[PathKUP].NS, kup.Pid(), fmt.Sprintf("kup-bench-heap-%d.pprof", scale))
			logAllocs(t, nodes[PathKUP].NS, 65*time.Second, fmt.Sprintf("kup-bench-heap-%d-later.pprof", scale))
			// Its log up to the memory sample, periodic syncs included (with
			// KUP_BENCH_PROXY_ENV=GODEBUG=gctrace=1, the collections too).
			keepLog(t, kup.Process, fmt.Sprintf("kup-bench-proxy-restart-%d-sampled.log", scale))
		}

		if scale == cfg.handoverAt() {
			kup = handover(kup, scale)
		}
	}
	rep.Notes = append(rep.Notes,
		"Control plane: both proxies watch the same API server; `one more service` is the time, in a steady state (2 s after the last change), from the EndpointSlice's creation (the Service exists already) to the first TCP connection that gets an answer from the node (a fresh connection every 5 ms, so a SYN lost before the rules existed does not delay the figure). Both run with their default --iptables-min-sync-period (kube-proxy: 1 s).",
		"Full sync after restart: the mean of kubeproxy_sync_full_proxy_rules_duration_seconds (both proxies count full syncs separately from partial ones) scraped right after the restarted proxy served everything. Idle CPU: utime+stime from /proc/PID/stat over "+cfg.cpuWindow.String()+idleWhen(cfg)+". RSS after restart: VmRSS of each proxy at the end of that window (upstream kube-proxy holds the informers' copies of every Service and EndpointSlice and its iptables rule text; kube-userspace-proxy the same objects, a listener per service port and its rules).")
}

// idleWhen says where the idle CPU window starts.
func idleWhen(cfg settings) string {
	if cfg.steadyIdle {
		return ", starting 2 s after kube-userspace-proxy's first periodic full sync since its restart (a steady state for both: kube-proxy's periodic syncs within the hour are partial)"
	}
	return ", starting 2 s after the restarted proxies served everything"
}

// createServices creates services bulk-<from>..bulk-<to-1> with one endpoint each (8 workers)
// and returns the last one.
func createServices(t *testing.T, c *cluster.Cluster, from, to int, ep harness.Endpoint) *corev1.Service {
	ctx := context.Background()
	svcs := make([]*corev1.Service, to)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	for w := range 8 {
		wg.Go(func() {
			for i := from + w; i < to; i += 8 {
				s := harness.ClusterIPService(fmt.Sprintf("bulk-%05d", i), harness.TCPPort("tcp", 80, echoPort))
				cs, err := c.Client.CoreV1().Services(s.Namespace).Create(ctx, s, metav1.CreateOptions{})
				if err == nil {
					_, err = c.Client.DiscoveryV1().EndpointSlices(s.Namespace).Create(ctx, harness.Slice(cs, ep), metav1.CreateOptions{})
				}
				if err != nil {
					mu.Lock()
					firstErr = cmpErr(firstErr, err)
					mu.Unlock()
					return
				}
				svcs[i] = cs
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		t.Fatalf("create services: %v", firstErr)
	}
	return svcs[to-1]
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// firstSync waits (at most a minute) until the proxy in ns has finished a sync since it started
// and returns the mean of its full-sync durations in ms. (kube-proxy leaves its rules in place
// when it stops, so the restarted one serves before its first sync has ended.)
func firstSync(ns *netns.NS) (float64, error) {
	deadline := time.Now().Add(time.Minute)
	for {
		d, err := scrapeSyncMean(ns)
		if err == nil || time.Now().After(deadline) {
			return d, err
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// waitPeriodicFullSync waits until the proxy in ns has counted one more full sync than it had
// when called (the restart's first sync is counted before this is called).
func waitPeriodicFullSync(ns *netns.NS, timeout time.Duration) error {
	count := func() (float64, error) {
		samples, err := harness.ScrapeMetrics(ns, metricsAddr)
		if err != nil {
			return 0, err
		}
		n := 0.0
		for k, v := range samples {
			if name, _, _ := strings.Cut(k, "{"); name == "kubeproxy_sync_full_proxy_rules_duration_seconds_count" {
				n += v
			}
		}
		return n, nil
	}
	start, err := count()
	if err != nil {
		return fmt.Errorf("full syncs: %w", err)
	}
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		time.Sleep(500 * time.Millisecond)
		if n, err := count(); err == nil && n > start {
			return nil
		}
	}
	return fmt.Errorf("no periodic full sync within %v (still %v)", timeout, start)
}

// scrapeSyncMean scrapes the sync-duration histogram of the proxy in ns and returns its mean in
// ms, or an error while no sync has been observed.
func scrapeSyncMean(ns *netns.NS) (float64, error) {
	samples, err := harness.ScrapeMetrics(ns, metricsAddr)
	if err != nil {
		return 0, err
	}
	vals := map[string]float64{} // metric name without labels → sum over label sets
	for k, v := range samples {
		name, _, _ := strings.Cut(k, "{")
		vals[name] += v
	}
	// Both proxies count their full syncs separately (the first sync after a start is full).
	metric := "kubeproxy_sync_full_proxy_rules_duration_seconds"
	if vals[metric+"_count"] == 0 {
		metric = "kubeproxy_sync_proxy_rules_duration_seconds"
	}
	sum, count := vals[metric+"_sum"], vals[metric+"_count"]
	if count == 0 {
		return 0, errors.New("no sync duration in the metrics")
	}
	return sum / count * 1e3, nil
}

// cpuPercent samples utime+stime of pid over window, in percent of one core.
func cpuPercent(pid int, window time.Duration) (float64, error) {
	ticks := func() (float64, error) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return 0, fmt.Errorf("read stat: %w", err)
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndex(s, ")")+2:])
		u, _ := strconv.ParseFloat(f[11], 64) // field 14 utime
		k, _ := strconv.ParseFloat(f[12], 64) // field 15 stime
		return u + k, nil
	}
	a, err := ticks()
	if err != nil {
		return 0, err
	}
	time.Sleep(window)
	b, err := ticks()
	if err != nil {
		return 0, err
	}
	return (b - a) / 100 / window.Seconds() * 100, nil // USER_HZ is 100 on Linux
}

func rssKiB(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, fmt.Errorf("read status: %w", err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			return strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	return 0, errors.New("no VmRSS")
}

// conntrackObjSize returns the size of a conntrack entry's slab object, or 0.
func conntrackObjSize() int {
	b, err := os.ReadFile("/proc/slabinfo")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) > 3 && f[0] == "nf_conntrack" {
			v, _ := strconv.Atoi(f[3])
			return v
		}
	}
	return 0
}

func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

func machine(t *testing.T) string {
	out := func(args ...string) string {
		b, _ := exec.Command(args[0], args[1:]...).CombinedOutput()
		return firstLine(strings.TrimSpace(string(b)), 60)
	}
	return fmt.Sprintf("%d CPUs, kernel %s, %s, %s, %s", runtime.NumCPU(), out("uname", "-r"), runtime.Version(), out("haproxy", "-v"), out("iperf3", "--version"))
}

func writeReport(t *testing.T, rep *Report, dir string, maxScale int) {
	if rep.Finished.IsZero() {
		rep.Finished = time.Now()
		rep.LoadEnd = loadavg()
		rep.Notes = append(rep.Notes, "INCOMPLETE: the run failed before the end.")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Errorf("results: %v", err)
		return
	}
	var md strings.Builder
	_ = rep.WriteMarkdown(&md)
	_ = rep.WriteTargets(&md, Targets(maxScale))
	fmt.Println(md.String())
	for name, write := range map[string]func(f *os.File) error{
		"results.md":   func(f *os.File) error { _, err := f.WriteString(md.String()); return err },
		"results.json": func(f *os.File) error { return rep.WriteJSON(f) },
		"ratios.svg":   func(f *os.File) error { return rep.WriteSVG(f) },
	} {
		f, err := os.Create(filepath.Join(dir, name))
		if err == nil {
			err = write(f)
			err = cmpErr(err, f.Close())
		}
		if err != nil {
			t.Errorf("results %s: %v", name, err)
		}
	}
	t.Logf("results written to %s", dir)
}

// firstAnswer returns how long after t0 the first TCP connection to addr from ns got an answer.
// It starts a fresh connection every probeEvery, each with its own source port and timeout, so
// that a connection whose SYN went nowhere before the rules existed (and waits for its
// retransmission) does not hide the moment the rules arrived: the figure is exact to within
// probeEvery plus one round trip.
func firstAnswer(ctx context.Context, ns *netns.NS, addr string, t0 time.Time) (time.Duration, error) {
	const probeEvery, perProbe, limit = 5 * time.Millisecond, time.Second, 60 * time.Second
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	answered := make(chan time.Duration, 1)
	var wg sync.WaitGroup
	defer wg.Wait()
	tick := time.NewTicker(probeEvery)
	defer tick.Stop()
	for {
		wg.Go(func() {
			if _, err := harness.AskTimeout(ctx, ns, "tcp", addr, perProbe); err == nil {
				select {
				case answered <- time.Since(t0):
				default:
				}
			}
		})
		select {
		case d := <-answered:
			cancel()
			return d, nil
		case <-ctx.Done():
			return 0, fmt.Errorf("no answer from %s within %v", addr, limit)
		case <-tick.C:
		}
	}
}

// runHandover is the hand-over row: with cfg.handoverConns idle connections held from the client
// pod through kube-userspace-proxy (at most what its descriptor budget leaves room for) and
// scale services, a successor with the same configuration is started on the node. It measures
// the successor's own hand-over duration (its metrics: hello → release), the time from its
// start to the old process's exit and to the first new connection answered after that, and
// how many of the held connections still answer a request. If the hand-over fails for want of
// descriptors (the predecessor duplicates every descriptor it hands over), it is noted and
// measured again with as many connections as leave room for that. It returns the proxy running
// after it: the successor, or old if the hand-over failed (noted, not fatal).
func runHandover(t *testing.T, rep *Report, cfg settings, scale int, tg target, loadBin string, old *harness.Proxy, kupCfg harness.ProxyConfig) *harness.Proxy {
	name := fmt.Sprintf("hand-over with %d idle connections, %d services", cfg.handoverConns, scale)
	ho := handoverRows{
		held:     rep.Metric(name+": connections held", "pod", "conns", true),
		dur:      rep.Metric(name+": successor's hand-over (hello → release)", "pod", "ms", false),
		exited:   rep.Metric(name+": successor start → old proxy exited", "pod", "ms", false),
		answered: rep.Metric(name+": successor start → new connection answered", "pod", "ms", false),
		survived: rep.Metric(name+": connections surviving", "pod", "conns", true),
	}
	for _, m := range ho.all() {
		m.Note(PathDirect, "n/a (no proxy)")
		m.Note(PathIPTables, "n/a (kernel state survives a restart)")
		m.Note(PathHAProxy, "n/a")
	}
	rep.Notes = append(rep.Notes, fmt.Sprintf("Hand-over, at %d services: the client pod opens up to %d idle connections through kube-userspace-proxy (kup-load idle; "+
		"each made one request), then a second proxy with the same flags is started on the node; it takes everything over and the first exits. "+
		"`successor's hand-over` is the successor's kube_userspace_proxy_handover_duration_seconds{role=\"successor\"} (hello → release, scraped from it); "+
		"`start → old proxy exited` and `start → new connection answered` are wall time from starting the successor's process to the first process's exit, "+
		"and to the first new connection from the pod answered after that exit (one every 10 ms); `connections surviving` is how many of the held connections "+
		"answer one more request after the hand-over (all at once, 8 in parallel, within 10 s). `connections held` is capped so that the proxy's descriptor budget "+
		"(the open-files limit less its reserve and one descriptor per listener; 2 per connection) keeps room for new connections. "+
		"iptables mode has nothing to hand over: a kube-proxy restart leaves the kernel's rules and conntrack in place "+
		"(its restart's first full sync is the `full sync after restart` row).", scale, cfg.handoverConns))

	// As many connections as asked, or as the budget leaves room for (less 100 connections'
	// worth for new connections and splice pipes).
	count := cfg.handoverConns
	if m, err := harness.ScrapeMetrics(tg.node.NS, metricsAddr); err != nil {
		t.Logf("hand-over: scraping the budget: %v", err)
	} else if limit, ok := m[`kube_userspace_proxy_data_path_descriptors{state="limit"}`]; ok {
		room := (int(limit)-int(m[`kube_userspace_proxy_data_path_descriptors{state="in_use"}`]))/2 - 100
		count = max(min(count, room), 1)
	}
	// Room for the hand-over itself: the predecessor holds a duplicate of every listener and
	// connection socket at once, so its descriptors double.
	fds, fdLimit := fdCount(old.Pid()), fdLimitOf(old.Pid())
	next, res := handoverOnce(t, tg, loadBin, old, kupCfg, count)
	if res.err != nil && (strings.Contains(res.err.Error(), "too many open files") || strings.Contains(res.err.Error(), "not enough room")) && fds > 0 && fdLimit > 0 {
		retry := max((fdLimit-2*fds)/4-100, 1)
		why := fmt.Sprintf("%d held: hand-over refused (%s); again with %d", res.held, firstLine(res.err.Error(), 200), retry)
		rep.Notes = append(rep.Notes, fmt.Sprintf("Hand-over at %d services with %d connections held refused: %s. "+
			"The predecessor duplicates every listening and connection socket before it sends them (proxy/forward/tcp, handover_linux.go: export), so it needs twice "+
			"the descriptors its data path holds; it checks for that room before freezing anything and refuses otherwise (open-files limit %d, %d open before the connections): "+
			"measured again with %d connections, the most for which (limit − 2 × open) / 4 leaves room, after a restart of the old proxy. After the refusal, the old proxy: %s.",
			scale, res.held, firstLine(res.err.Error(), 300), fdLimit, fds, retry, firstLine(res.after, 2000)))
		t.Logf("hand-over: %s", why)
		ho.held.Note(PathKUP, firstLine(fmt.Sprintf("asked %d; with %d the hand-over was refused (descriptors), see notes", cfg.handoverConns, res.held), 100))
		// The refused predecessor is not in the state it was before (see res.after: what it
		// logged, how many held connections still answer): restart it, so that the second
		// attempt starts from a proxy as the first did.
		if next == old {
			old.Stop()
			next = harness.StartProxy(t, tg.node.NS, kupCfg)
		}
		next, res = handoverOnce(t, tg, loadBin, next, kupCfg, retry)
	}
	ho.record(t, res, cfg.handoverConns)
	return next
}

// handoverRows are the metrics of runHandover.
type handoverRows struct{ held, dur, exited, answered, survived *Metric }

func (h handoverRows) all() []*Metric {
	return []*Metric{h.held, h.dur, h.exited, h.answered, h.survived}
}

// handoverResult is what one hand-over attempt measured (zero: not measured).
type handoverResult struct {
	held, moved, survived int
	dur, exited, answered time.Duration
	check, oldExit, after string // the CHECK line, the old proxy's exit error, what served after a failure
	err                   error
}

func (h handoverRows) record(t *testing.T, r handoverResult, asked int) {
	if r.held > 0 {
		h.held.Add(PathKUP, float64(r.held))
		if r.held < asked && h.held.Notes[PathKUP] == "" {
			h.held.Note(PathKUP, fmt.Sprintf("asked %d: open-files limit", asked))
		}
	}
	if r.err != nil {
		t.Logf("hand-over: %v", r.err)
		for _, m := range h.all()[1:] {
			m.Note(PathKUP, "error: "+firstLine(r.err.Error(), 80))
		}
		return
	}
	h.dur.Add(PathKUP, float64(r.dur.Microseconds())/1e3)
	h.dur.Note(PathKUP, fmt.Sprintf("%d tcp-conn records", r.moved))
	h.exited.Add(PathKUP, float64(r.exited.Microseconds())/1e3)
	if r.oldExit != "" {
		h.exited.Note(PathKUP, "old proxy exited with "+r.oldExit)
	}
	h.answered.Add(PathKUP, float64(r.answered.Microseconds())/1e3)
	h.survived.Add(PathKUP, float64(r.survived))
	if r.survived < r.held {
		h.survived.Note(PathKUP, fmt.Sprintf("of %d held; %s", r.held, firstLine(r.check, 120)))
	} else {
		h.survived.Note(PathKUP, fmt.Sprintf("of %d held", r.held))
	}
}

// handoverOnce holds count idle connections through old, starts a successor and measures the
// hand-over. It returns the proxy serving afterwards (the successor, or old if the hand-over
// failed: the successor is stopped as soon as it says so).
func handoverOnce(t *testing.T, tg target, loadBin string, old *harness.Proxy, kupCfg harness.ProxyConfig, count int) (*harness.Proxy, handoverResult) {
	ctx := context.Background()
	var res handoverResult
	proc := tg.pod.NS.Start(t, loadBin, "idle", "--addr", tg.echo, "--count", strconv.Itoa(count), "--hold", "600s")
	defer func() {
		proc.Stop()
		time.Sleep(2 * time.Second) // let the proxy close its side
	}()
	res.held = -1
	openStart := time.Now()
	for deadline := time.Now().Add(180 * time.Second); time.Now().Before(deadline); {
		if i := strings.Index(proc.Log(), "READY "); i >= 0 {
			fmt.Sscanf(proc.Log()[i:], "READY %d", &res.held)
			break
		}
		select {
		case <-proc.Done():
			deadline = time.Now()
		case <-time.After(100 * time.Millisecond):
		}
	}
	if res.held <= 0 {
		res.err = fmt.Errorf("opening the connections: held %d: %s", res.held, firstLine(proc.Log(), 200))
		return old, res
	}
	t.Logf("hand-over: %d connections held (asked %d) in %v", res.held, count, time.Since(openStart).Round(time.Millisecond))
	time.Sleep(time.Second)

	// The successor. Its process's start is the origin; a watcher takes the old process's
	// exit, then asks a new connection every 10 ms until one is answered.
	var exitAt, answerAt atomic.Int64 // nanoseconds since start; 0: not yet
	args := harness.ProxyArgs(t, kupCfg)
	oldLogFrom := len(old.Log())
	start := time.Now()
	next := &harness.Proxy{Config: kupCfg, Args: args, Started: start, Process: tg.node.NS.Start(t, args...)}
	next.DumpGoroutinesOnFailure()
	wctx, cancel := context.WithTimeout(ctx, 120*time.Second)
	defer cancel()
	go func() {
		select {
		case <-old.Done():
			exitAt.Store(int64(time.Since(start)))
		case <-wctx.Done():
			return
		}
		for wctx.Err() == nil {
			if _, err := harness.AskTimeout(wctx, tg.pod.NS, "tcp", tg.echo, time.Second); err == nil {
				answerAt.Store(int64(time.Since(start)))
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()
	refused := ""
	for answerAt.Load() == 0 && wctx.Err() == nil && refused == "" {
		select {
		case <-next.Done():
			cancel()
		case <-time.After(20 * time.Millisecond):
			refused = grepLine(next.Log(), "falling back to a restart")
		}
	}
	if answerAt.Load() == 0 {
		cancel()
		if refused != "" {
			if i := strings.Index(refused, `error="`); i >= 0 {
				refused, _, _ = strings.Cut(refused[i+len(`error="`):], `"`)
			}
			res.err = fmt.Errorf("successor: %s", refused)
		} else {
			res.err = fmt.Errorf("hand-over: after %v: old exited: %v, successor: %s", time.Since(start).Round(time.Millisecond), exitAt.Load() != 0, firstLine(next.Tail(3), 200))
		}
		t.Logf("hand-over failed; successor's log:\n%s\nold proxy's log:\n%s", next.Tail(30), old.Tail(30))
		select {
		case <-old.Done():
			return next, res
		default:
		}
		next.Stop() // it waits for the old one's lock: it has touched nothing yet
		// Does the old proxy serve on? Its held connections, and a new one.
		answers := "a new connection answered"
		if _, err := harness.AskTimeout(ctx, tg.pod.NS, "tcp", tg.echo, 2*time.Second); err != nil {
			answers = "a new connection failed: " + firstLine(err.Error(), 80)
		}
		line, err := checkIdle(proc)
		res.after = fmt.Sprintf("%s; of the held connections: %s", answers, line)
		if err != nil {
			res.after += fmt.Sprintf(" (%v)", err)
		}
		// What the failed freeze left: the old proxy's log since the successor started.
		if log := old.Log(); len(log) >= oldLogFrom {
			log = log[oldLogFrom:]
			res.after += fmt.Sprintf("; its log since: %d lines with \"too many open files\" (%d \"cannot serve the handed-over listener\", %d \"accept: out of file descriptors\"), "+
				"%d listeners reopened on another proxy port (\"allocating another\")",
				strings.Count(log, "too many open files"), strings.Count(log, "cannot serve the handed-over listener"), strings.Count(log, "accept: out of file descriptors"),
				strings.Count(log, "allocating another"))
			for _, what := range []string{"adopted what the predecessor handed over", "opened proxy listeners"} {
				if l := lastLine(log, what); l != "" {
					res.after += "; \"" + what + "\": " + strings.Join(fieldsWith(l, "listeners=", "heldPorts=", "tcpConnections=", "servicePorts="), " ")
				}
			}
		}
		t.Logf("hand-over: after the failed hand-over: %s; the old proxy's warnings and errors: %s", res.after, firstLine(grepLevel(old.Log()), 2000))
		return old, res
	}
	next.Ready = start.Add(time.Duration(answerAt.Load()))
	res.exited, res.answered = time.Duration(exitAt.Load()), time.Duration(answerAt.Load())
	if err := old.Err(); err != nil {
		res.oldExit = err.Error()
		t.Logf("hand-over: the old proxy exited with %v; its log:\n%s", err, old.Tail(20))
	}

	m, err := harness.ScrapeMetrics(tg.node.NS, metricsAddr)
	switch {
	case err != nil:
		res.err = fmt.Errorf("scraping the successor: %w", err)
		return next, res
	case m[`kube_userspace_proxy_handovers_total{result="completed",role="successor"}`] != 1:
		res.err = fmt.Errorf("successor's handovers_total{completed,successor} = %v, want 1", m[`kube_userspace_proxy_handovers_total{result="completed",role="successor"}`])
		return next, res
	}
	res.dur = time.Duration(m[`kube_userspace_proxy_handover_duration_seconds_sum{role="successor"}`] * float64(time.Second))
	res.moved = int(m[`kube_userspace_proxy_handover_records_total{kind="tcp-conn",role="successor"}`])

	// Every held connection asked once more.
	line, err := checkIdle(proc)
	if err != nil {
		res.err = err
		return next, res
	}
	res.check = line
	fmt.Sscanf(line, "CHECK ok=%d", &res.survived)
	t.Logf("MEASURE hand-over with %d connections held: successor's duration %v, old exited after %v, new connection answered after %v; %s; successor: %s",
		res.held, res.dur.Round(time.Millisecond), res.exited.Round(time.Millisecond), res.answered.Round(time.Millisecond), line, firstLine(grepLine(next.Log(), "took over"), 300))
	return next, res
}

// checkIdle makes kup-load idle (proc) ask every connection it holds once more and returns its
// CHECK line.
func checkIdle(proc *netns.Process) (string, error) {
	before := strings.Count(proc.Log(), "CHECK ")
	if err := syscall.Kill(proc.Pid(), syscall.SIGUSR1); err != nil {
		return "", fmt.Errorf("checking the connections: %w", err)
	}
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		log := proc.Log()
		if strings.Count(log, "CHECK ") > before {
			line, _, _ := strings.Cut(log[strings.LastIndex(log, "CHECK "):], "\n")
			return line, nil
		}
	}
	return "", fmt.Errorf("checking the connections: no CHECK line from kup-load: %s", firstLine(proc.Tail(3), 200))
}

// lastLine returns the last line of log containing s, or "".
func lastLine(log, s string) string {
	i := strings.LastIndex(log, s)
	if i < 0 {
		return ""
	}
	start := strings.LastIndexByte(log[:i], '\n') + 1
	end, _, _ := strings.Cut(log[start:], "\n")
	return end
}

// fieldsWith returns the space-separated fields of line that start with one of prefixes.
func fieldsWith(line string, prefixes ...string) []string {
	var out []string
	for _, f := range strings.Fields(line) {
		for _, p := range prefixes {
			if strings.HasPrefix(f, p) {
				out = append(out, f)
			}
		}
	}
	return out
}

// grepLevel returns the WRN and ERR lines of a proxy's log, joined with " / ".
func grepLevel(log string) string {
	var out []string
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(l, " WRN ") || strings.Contains(l, " ERR ") {
			out = append(out, l)
		}
	}
	return strings.Join(out, " / ")
}

// fdCount returns how many descriptors pid has open (0 if unknown).
func fdCount(pid int) int {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return 0
	}
	return len(ents)
}

// fdLimitOf returns pid's soft open-files limit (0 if unknown).
func fdLimitOf(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, "Max open files"); ok {
			if f := strings.Fields(rest); len(f) > 0 {
				n, _ := strconv.Atoi(f[0])
				return n
			}
		}
	}
	return 0
}

// grepLine returns the first line of log containing s, or "".
func grepLine(log, s string) string {
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(l, s) {
			return l
		}
	}
	return ""
}

// logMemory logs, for a KUP_BENCH_PROXY_LOG run, what the RSS of kube-userspace-proxy (pid, in
// ns) is made of: the Go runtime's memory statistics from its metrics and the kernel's
// anonymous and file-backed shares.
func logMemory(t *testing.T, ns *netns.NS, pid int, heapFile string) {
	var lines []string
	if samples, err := harness.ScrapeMetrics(ns, metricsAddr); err != nil {
		lines = append(lines, "metrics: "+err.Error())
	} else {
		for _, k := range slices.Sorted(maps.Keys(samples)) {
			if strings.HasPrefix(k, "go_memstats_") && strings.HasSuffix(k, "_bytes") || strings.HasPrefix(k, "go_gc_gogc") || strings.HasPrefix(k, "go_memstats_gc_") {
				lines = append(lines, fmt.Sprintf("%s %.1f MiB", k, samples[k]/(1<<20)))
			}
		}
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid)); err != nil {
		lines = append(lines, "smaps_rollup: "+err.Error())
	} else {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "Rss:") || strings.HasPrefix(l, "Anonymous:") || strings.HasPrefix(l, "Pss_File:") || strings.HasPrefix(l, "Pss_Anon:") {
				lines = append(lines, strings.Join(strings.Fields(l), " "))
			}
		}
	}
	// Then a heap profile as of a collection, kept in the temporary directory like the logs.
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: ns.DialContext, DisableKeepAlives: true}}
	if resp, err := hc.Get("http://" + metricsAddr + "/debug/pprof/heap?gc=1"); err != nil {
		lines = append(lines, "heap profile: "+err.Error())
	} else {
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		path := filepath.Join(os.TempDir(), heapFile)
		if err == nil {
			err = os.WriteFile(path, b, 0o644)
		}
		lines = append(lines, fmt.Sprintf("heap profile %s: %v", path, err))
	}
	t.Logf("memory of kube-userspace-proxy (pid %d):\n%s", pid, strings.Join(lines, "\n"))
}

// logAllocs keeps, for a KUP_BENCH_PROXY_LOG run, a heap profile of kube-userspace-proxy (in
// ns) taken d after logMemory's, each after a collection, in the temporary directory: with
// logMemory's as the base (go tool pprof -sample_index=alloc_space -base), what the idle proxy
// allocated meanwhile — periodic syncs, scrapes —, which is what moves its heap between
// collections. (A delta profile, allocs?seconds=, shows nothing when no collection ran in its
// window: an idle proxy's allocations are published only by collections.)
func logAllocs(t *testing.T, ns *netns.NS, d time.Duration, file string) {
	time.Sleep(d)
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: ns.DialContext, DisableKeepAlives: true}}
	resp, err := hc.Get("http://" + metricsAddr + "/debug/pprof/heap?gc=1")
	if err != nil {
		t.Logf("heap profile %v later: %v", d, err)
		return
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	path := filepath.Join(os.TempDir(), file)
	if err == nil {
		err = os.WriteFile(path, b, 0o644)
	}
	t.Logf("heap profile of kube-userspace-proxy %v after the memory sample: %s: %v", d, path, err)
}

// profilingArgs turns on kube-userspace-proxy's profiles for a KUP_BENCH_PROXY_LOG run (see
// logMemory).
func profilingArgs(cfg settings) []string {
	if cfg.proxyLog == "" {
		return nil
	}
	return []string{"--profiling"}
}
