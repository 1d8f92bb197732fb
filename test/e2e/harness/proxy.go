//go:build linux

package harness

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// DefaultReadyTimeout bounds StartProxy's wait for ProxyConfig.Ready when
// ProxyConfig.ReadyTimeout is zero.
const DefaultReadyTimeout = 60 * time.Second

// ProxyConfig says how StartProxy runs kube-userspace-proxy. The zero value is not useful: set
// NodeName and one of Kubeconfig or Manifests.
type ProxyConfig struct {
	// NodeName is passed as --hostname-override.
	NodeName string
	// Kubeconfig is passed as --kubeconfig when not empty.
	Kubeconfig string
	// Manifests is passed as --manifests when not empty.
	Manifests string
	// HealthzBindAddress and MetricsBindAddress are passed as given; empty disables the server
	// (so two proxies in different namespaces never need distinct ports).
	HealthzBindAddress, MetricsBindAddress string
	// LogLevel is passed as --log-level; empty means "debug" (the sync log is in the test's
	// output on failure).
	LogLevel string
	// Args are appended last (later flags win).
	Args []string
	// Wrapper, if set, is a command line the proxy is run under: the proxy's command line is
	// appended to it, so it must exec its arguments in the same process (prlimit, setpriv, env
	// do), which keeps [netns.Process.Pid] the proxy's.
	Wrapper []string
	// Ready, if set, is polled (every 100ms) until it returns nil: StartProxy returns only then.
	// Typically it asks a service port (see [Ask]). If nil, StartProxy waits until the proxy has
	// completed a sync with the source's initial state (its debug log says "synced"), which needs
	// the debug log level.
	Ready func(ctx context.Context) error
	// ReadyTimeout bounds the wait for Ready; zero means DefaultReadyTimeout.
	ReadyTimeout time.Duration
}

// Proxy is a running kube-userspace-proxy.
type Proxy struct {
	*netns.Process
	// Config is the configuration it was started with.
	Config ProxyConfig
	// Args are its complete command line.
	Args []string
	// Started is when the process was started; Ready is when StartProxy saw it ready.
	Started, Ready time.Time
}

// ProxyArgs returns the command line StartProxy runs for cfg.
func ProxyArgs(t testing.TB, cfg ProxyConfig) []string {
	t.Helper()
	level := cfg.LogLevel
	if level == "" {
		level = "debug"
	}
	args := append(append([]string(nil), cfg.Wrapper...), ProxyBinary(t),
		"--hostname-override="+cfg.NodeName,
		"--healthz-bind-address="+cfg.HealthzBindAddress,
		"--metrics-bind-address="+cfg.MetricsBindAddress,
		"--log-level="+level,
	)
	if cfg.Kubeconfig != "" {
		args = append(args, "--kubeconfig="+cfg.Kubeconfig)
	}
	if cfg.Manifests != "" {
		args = append(args, "--manifests="+cfg.Manifests)
	}
	return append(args, cfg.Args...)
}

// StartProxy runs kube-userspace-proxy inside ns and waits until it is ready (see
// ProxyConfig.Ready). It fails the test if the proxy exits or is not ready in time. The process
// is killed in the test's cleanup if still running; use [Proxy.Terminate] for a clean stop.
func StartProxy(t testing.TB, ns *netns.NS, cfg ProxyConfig) *Proxy {
	t.Helper()
	args := ProxyArgs(t, cfg)
	p := &Proxy{Config: cfg, Args: args, Started: time.Now()}
	p.Process = ns.Start(t, args...)
	p.DumpGoroutinesOnFailure()
	timeout := cfg.ReadyTimeout
	if timeout <= 0 {
		timeout = DefaultReadyTimeout
	}
	ready := cfg.Ready
	if ready == nil {
		ready = func(context.Context) error {
			if !strings.Contains(p.Log(), " synced ") && !strings.HasSuffix(strings.TrimSpace(p.Log()), " synced") {
				return errors.New("no completed sync in the log yet")
			}
			return nil
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	err := poll(ctx, 100*time.Millisecond, func() error {
		select {
		case <-p.Done():
			return stopPolling{fmt.Errorf("exited (%v)", p.Err())}
		default:
		}
		cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
		defer ccancel()
		return ready(cctx)
	})
	if err != nil {
		t.Fatalf("harness: proxy %s not ready after %v: %v; log:\n%s", p.Process, time.Since(p.Started).Round(time.Millisecond), err, p.Tail(40))
	}
	p.Ready = time.Now()
	return p
}

// Terminate sends SIGTERM and waits up to timeout for the process to exit; it returns the exit
// error (nil for exit status 0) or an error if the process did not exit in time (it is killed
// then).
func (p *Proxy) Terminate(timeout time.Duration) error {
	select {
	case <-p.Done():
		return fmt.Errorf("proxy had exited already: %v", p.Err())
	default:
	}
	if err := syscall.Kill(p.Pid(), syscall.SIGTERM); err != nil {
		return fmt.Errorf("SIGTERM proxy %s: %w", p.Process, err)
	}
	select {
	case <-p.Done():
		return p.Err()
	case <-time.After(timeout):
		p.Stop()
		return fmt.Errorf("proxy %s did not exit within %v of SIGTERM", p.Process, timeout)
	}
}

// RunCleanup runs `kube-userspace-proxy --cleanup` inside ns and returns its output, failing the
// test if it does not exit 0.
func RunCleanup(t testing.TB, ns *netns.NS) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := ns.Exec(ctx, ProxyBinary(t), "--cleanup")
	if err != nil {
		t.Fatalf("harness: kube-userspace-proxy --cleanup: %v", err)
	}
	return out
}
