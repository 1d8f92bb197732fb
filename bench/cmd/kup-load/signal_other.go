//go:build !unix

package main

import "os"

// notifyCheck does nothing where there is no SIGUSR1: idle only holds its connections.
func notifyCheck(chan<- os.Signal) {}
