//go:build linux

// Command pause is the local cluster's pod sandbox image (hack/cluster.sh): the first process of
// every pod, holding its namespaces. It waits for SIGTERM or SIGINT and exits 0; as PID 1 of the
// pod it also reaps children that reparent to it.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			return
		}
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
