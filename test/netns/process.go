//go:build linux

package netns

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// tailLines is how many lines of a process's log a failed test shows.
const tailLines = 40

// Process is a long-running command started inside a namespace by [NS.Start]. Its stdout and
// stderr go to a log file in the test's temporary directory; when the test fails, the last
// lines of that log are written to the test log.
type Process struct {
	ns      *NS
	args    []string
	cmd     *exec.Cmd
	logPath string
	done    chan struct{} // closed when the process has exited and been reaped
	err     error         // the Wait result; read only after done is closed
	// goDump (DumpGoroutinesOnFailure): a failed test's cleanup makes the process, a Go program,
	// dump its goroutines (SIGQUIT) and shows a digest of them.
	goDump atomic.Bool
}

// Start starts a long-running command inside the namespace (through `ip netns exec`) in a
// process group of its own, and registers in t.Cleanup that the group is killed (SIGKILL) and
// reaped. It fails the test if the command cannot be started. If the test binary dies, the
// kernel kills the command too (parent-death signal).
func (ns *NS) Start(t testing.TB, args ...string) *Process {
	t.Helper()
	if len(args) == 0 {
		t.Fatalf("netns: start in %s: no command", ns.name)
	}
	ns.mu.Lock()
	ns.seq++
	seq := ns.seq
	ns.mu.Unlock()
	logPath := filepath.Join(t.TempDir(), fmt.Sprintf("%s-%s-%d.log", ns.name, filepath.Base(args[0]), seq))
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatalf("netns: start %q in %s: %v", args, ns.name, err)
	}
	defer logFile.Close() // the child has its own descriptor
	cmd := exec.Command("ip", append([]string{"netns", "exec", ns.name}, args...)...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatalf("netns: start %q in %s: %v", args, ns.name, err)
	}
	p := &Process{ns: ns, args: args, cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go p.wait()
	ns.mu.Lock()
	ns.procs = append(ns.procs, p)
	ns.mu.Unlock()
	t.Cleanup(func() {
		digest := ""
		if t.Failed() && p.goDump.Load() {
			digest = p.quitAndDigest()
		}
		p.Stop()
		if t.Failed() {
			t.Logf("netns: last lines of %s (%q in %s):\n%s", filepath.Base(p.logPath), p.args, ns.name, p.Tail(tailLines))
		}
		if digest != "" {
			t.Logf("netns: goroutines of %q in %s when the test failed (one line each: state, then its innermost frames of this module):\n%s", p.args, ns.name, digest)
		}
	})
	return p
}

// wait reaps the process; it is the only goroutine a Process owns, and it ends with the process.
func (p *Process) wait() {
	p.err = p.cmd.Wait()
	close(p.done)
}

// Pid returns the process id (also its process group id).
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// LogPath returns the file that receives the process's stdout and stderr. It is removed with the
// test's temporary directory.
func (p *Process) LogPath() string { return p.logPath }

// Done returns a channel closed when the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Err returns how the process exited (see exec.Cmd.Wait). Call it only after Done is closed.
func (p *Process) Err() error { return p.err }

// DumpGoroutinesOnFailure marks the process as a Go program whose goroutines a failed test
// wants to see: the cleanup sends it SIGQUIT (the Go runtime prints every goroutine's stack and
// exits), then logs a digest, which shows where a hung process is stuck.
func (p *Process) DumpGoroutinesOnFailure() { p.goDump.Store(true) }

// quitAndDigest sends a running process SIGQUIT, waits for it to exit, and returns a digest of
// the goroutine dump it printed ("" when it was not running or printed none).
func (p *Process) quitAndDigest() string {
	select {
	case <-p.done:
		return ""
	default:
	}
	before := len(p.Log())
	if err := syscall.Kill(p.cmd.Process.Pid, syscall.SIGQUIT); err != nil {
		return ""
	}
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
	}
	log := p.Log()
	if len(log) < before {
		return ""
	}
	return goroutineDigest(log[before:], modulePath)
}

// modulePath prefixes the frames of this module in a goroutine dump.
const modulePath = "github.com/kube-userspace-proxy/kube-userspace-proxy/"

// goroutineDigest turns a Go goroutine dump into one line per goroutine: its header ("goroutine
// 7 [semacquire, 2 minutes]") and its three innermost frames in module (function names only).
// Goroutines with no such frame (the runtime's, client-go's own) are counted, not shown.
func goroutineDigest(dump, module string) string {
	var out []string
	others := 0
	for _, block := range strings.Split(dump, "\n\n") {
		lines := strings.Split(strings.TrimSpace(block), "\n")
		if len(lines) == 0 || !strings.HasPrefix(lines[0], "goroutine ") {
			continue
		}
		var frames []string
		for _, l := range lines[1:] {
			if strings.HasPrefix(l, module) && len(frames) < 3 {
				fn := strings.TrimPrefix(l, module)
				if i := strings.LastIndexByte(fn, '('); i > 0 {
					fn = fn[:i]
				}
				frames = append(frames, fn)
			}
		}
		if len(frames) == 0 {
			others++
			continue
		}
		out = append(out, strings.TrimSuffix(lines[0], ":")+" "+strings.Join(frames, " < "))
	}
	if len(out) == 0 {
		return ""
	}
	return strings.Join(out, "\n") + fmt.Sprintf("\n(%d goroutines without a frame of this module)", others)
}

// Stop kills the process group with SIGKILL and waits until the process is reaped. It is safe to
// call more than once and after the process exited.
func (p *Process) Stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL) // an exited group is fine
	select {
	case <-p.done:
	case <-time.After(cleanupTimeout):
		// Cannot happen short of a kernel hang; the namespace cleanup reports leftovers.
	}
}

// Log returns the whole log so far.
func (p *Process) Log() string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return fmt.Sprintf("(read %s: %v)", p.logPath, err)
	}
	return string(b)
}

// Tail returns the last n lines of the log.
func (p *Process) Tail(n int) string {
	b := bytes.TrimRight([]byte(p.Log()), "\n")
	lines := strings.Split(string(b), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// String describes the process for messages.
func (p *Process) String() string {
	return fmt.Sprintf("%q in %s (pid %d)", p.args, p.ns.name, p.cmd.Process.Pid)
}
