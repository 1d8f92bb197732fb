//go:build unix

package conntrack

import (
	"os/exec"
	"syscall"
)

// killGroup makes cmd's cancellation kill its whole process group: the tool's children too,
// which would otherwise outlive a timed-out run.
func killGroup(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
}
