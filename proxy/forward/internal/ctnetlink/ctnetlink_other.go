//go:build !linux

package ctnetlink

// Conn stands for Linux's ctnetlink socket, which other systems do not have.
type Conn struct{}
