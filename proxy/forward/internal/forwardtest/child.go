package forwardtest

import (
	"bytes"
	"io"
	"os/exec"
	"testing"
)

// Child is a copy of the test binary (or a command wrapping it, such as strace) running one
// of the child modes, with pipes to its standard input and output and its standard error kept.
type Child struct {
	Cmd    *exec.Cmd
	Stdin  io.WriteCloser
	Stdout io.ReadCloser
	Stderr bytes.Buffer // read it only after wait, or for a message after a failure
	waited bool
}

// StartChild starts cmd; the test's cleanup kills it unless wait was called.
func StartChild(t testing.TB, cmd *exec.Cmd) *Child {
	t.Helper()
	c := &Child{Cmd: cmd}
	var err error
	if c.Stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if c.Stdout, err = cmd.StdoutPipe(); err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = &c.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if !c.waited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return c
}

// Wait closes the child's standard input (its signal to finish) and waits for it to exit.
func (c *Child) Wait() error {
	c.Stdin.Close()
	c.waited = true
	return c.Cmd.Wait()
}
