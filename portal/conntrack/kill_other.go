//go:build !unix

package conntrack

import "os/exec"

// killGroup leaves cmd's cancellation as it is: only the tool itself is killed.
func killGroup(*exec.Cmd) {}
