//go:build linux

// Package e2e holds the end-to-end tests of kube-userspace-proxy: the real binary, a real
// kube-apiserver and etcd (package test/cluster), real iptables in network namespaces (package
// test/netns), and kup-echo backends in pod namespaces. They need root, iproute2, iptables and
// the binaries of `make test-bins`: without them they are skipped, saying what is missing, and
// under KUP_TEST_ALL=1 (make test, CI) they fail (see package internal/testenv).
package e2e

import (
	"os"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/e2e/harness"
)

func TestMain(m *testing.M) { os.Exit(harness.Main(m)) }
