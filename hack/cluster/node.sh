#!/usr/bin/env bash
# node.sh STATE NODE [CLUSTER]: one node of the local cluster (hack/cluster.sh), run by `hack/cluster.sh up`
# as `ip netns exec CLUSTER-NODE unshare --uts node.sh ...`, so it starts in the node's network
# namespace, in a UTS namespace of its own (hostname NODE, which hostNetwork pods share) and in a
# mount namespace of its own that receives the machine's mounts but sends none back.
#
# In that mount namespace it mounts what containerd and the kubelet need to see as their own:
#   /sys/fs/cgroup   the machine's cgroup hierarchies again (ip netns exec remounted /sys, which
#                    left the directory empty)
#   /run             a tmpfs (the shims' sockets, the xtables lock, hostPaths under /run)
#   /var             STATE/NODE/var (/var/lib/kubelet, /var/log/pods, /var/lib/cni, hostPaths
#                    under /var)
#   /proc/sys/...    files holding the values the kubelet would otherwise write machine-wide
# then starts containerd, waits for its socket, starts the kubelet and waits for both. Its own
# PID (STATE/NODE/node.pid) names the mount namespace for `hack/cluster.sh exec`.
set -euo pipefail
state=${1:?usage: node.sh STATE NODE}
node=${2:?usage: node.sh STATE NODE}
dir=$state/$node
cgroot=${3:-kupc}-$node

echo $$ >"$dir/node.pid"
hostname "$node"
mount -n --make-rslave /

# The cgroup hierarchies, as the machine mounts them (PID 1's view).
mount -n -t tmpfs -o mode=755 cgroup /sys/fs/cgroup
while read -r _ mnt fstype opts _; do
	case $mnt in /sys/fs/cgroup/*) ;; *) continue ;; esac
	case $fstype in cgroup | cgroup2) ;; *) continue ;; esac
	mkdir -p "$mnt"
	mount -n -t "$fstype" -o "$opts" "$fstype" "$mnt"
done </proc/1/mounts
# The kubelet's cgroupRoot in every hierarchy; cpuset needs cpus and mems before it takes tasks.
for h in /sys/fs/cgroup/*/; do
	mkdir -p "$h$cgroot"
	if [ -e "$h/cpuset.cpus" ]; then
		cat "$h/cpuset.cpus" >"$h$cgroot/cpuset.cpus"
		cat "$h/cpuset.mems" >"$h$cgroot/cpuset.mems"
	fi
done

mount -n -t tmpfs -o mode=755 run /run
mkdir -p "$dir/var"
mount -n --bind "$dir/var" /var

# The kubelet sets these machine-wide sysctls when they differ (protectKernelDefaults: false):
# here it reads the value it wants and leaves the machine alone.
mkdir -p "$dir/sysctl"
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
	kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
	key=${kv%%=*}
	f=$dir/sysctl/${key//\//.}
	echo "${kv#*=}" >"$f"
	mount -n --bind "$f" "/proc/sys/$key"
done

# Our own processes go into the node's cgroup (so `down` finds every descendant there).
for h in /sys/fs/cgroup/*/; do
	echo $$ >"$h$cgroot/cgroup.procs" 2>/dev/null || true
done

containerd --config "$dir/containerd.toml" >"$dir/containerd.log" 2>&1 &
echo $! >"$dir/containerd.pid"
for _ in $(seq 100); do
	[ -S "$dir/containerd.sock" ] && ctr -a "$dir/containerd.sock" version >/dev/null 2>&1 && break
	kill -0 "$(cat "$dir/containerd.pid")" 2>/dev/null || { echo "containerd exited; see $dir/containerd.log" >&2; exit 1; }
	sleep 0.1
done

# Images first (the caller leaves an archive of them), so no pod waits on a missing one; a node
# started again (hack/cluster.sh node-start) has them unless the archive is newer.
if [ -s "$state/images.tar" ] && ! [ "$dir/imported" -nt "$state/images.tar" ]; then
	ctr -a "$dir/containerd.sock" -n k8s.io images import "$state/images.tar" >"$dir/import.log" 2>&1 ||
		{ echo "image import failed; see $dir/import.log" >&2; exit 1; }
	touch "$dir/imported"
fi

"$KUP_K8S_BIN/kubelet" --config="$dir/kubelet.yaml" --kubeconfig="$dir/kubelet.kubeconfig" \
	--hostname-override="$node" --node-ip="$(cat "$dir/ip")" --cert-dir="$dir/pki" \
	--v="${KUP_CLUSTER_KUBELET_V:-1}" >"$dir/kubelet.log" 2>&1 &
echo $! >"$dir/kubelet.pid"
touch "$dir/started"
wait
