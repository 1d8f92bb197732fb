package app

import "github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"

// defaultHandoverSocket is the hand-over socket of an empty --handover-socket: this network
// namespace's, in InstanceLockDir.
func defaultHandoverSocket() (string, error) { return handover.Path(InstanceLockDir) }

// oomScoreAdjPath is where the process's oom_score_adj is set.
const oomScoreAdjPath = "/proc/self/oom_score_adj"

// validateOS checks the options only some systems refuse: Linux has everything.
func validateOS(*Options, func(flag, format string, args ...any)) {}
