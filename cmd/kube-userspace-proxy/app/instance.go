package app

import "errors"

// InstanceLockDir holds the lock files of running proxies (a hostPath in the DaemonSet, so that
// the pods of a rolling update see each other's).
const InstanceLockDir = "/run/kube-userspace-proxy"

// errInstanceRunning: another proxy holds the lock of this network namespace.
var errInstanceRunning = errors.New("another kube-userspace-proxy programs the portals of this network namespace")
