//go:build unix

package main

import (
	"os"
	"os/signal"
	"syscall"
)

// notifyCheck delivers SIGUSR1, the benchmark's request to check every idle connection, to c.
func notifyCheck(c chan<- os.Signal) { signal.Notify(c, syscall.SIGUSR1) }
