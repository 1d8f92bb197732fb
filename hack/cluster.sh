#!/usr/bin/env bash
# A real Kubernetes cluster on this one Linux machine (docs/cluster.md): etcd, kube-apiserver,
# kube-controller-manager and kube-scheduler in a control-plane network namespace, three nodes
# (node-1 .. node-3), each a network namespace with a mount namespace of its own running
# containerd + runc and a kubelet, with CNI bridge + host-local and routes to the other nodes' pod
# ranges, and a client namespace outside the cluster. All of them hang off one bridge in the
# control-plane namespace. The machine's own network namespace and iptables are never touched;
# the API server is reached from the machine through a loopback-only forwarder.
#
#   hack/cluster.sh up               check the dependencies, build what is missing (binaries,
#                                    images), start, wait until the nodes are Ready, deploy the
#                                    service proxy and CoreDNS and wait until they are Ready
#   hack/cluster.sh down             stop and remove everything up made (also after a failed up)
#   hack/cluster.sh status           the nodes and pods, or "down"
#   hack/cluster.sh kubeconfig       print the kubeconfig's path
#   hack/cluster.sh kubectl ARGS...  kubectl with that kubeconfig
#   hack/cluster.sh exec NODE CMD... run CMD in NODE's network (and mount) namespace
#   hack/cluster.sh client CMD...    run CMD in the client namespace (reaches the nodes' IPs)
#   hack/cluster.sh images           rebuild the images and import them into every node
#   hack/cluster.sh deploy           kubectl apply -k hack/cluster/deploy (deploy/ with the
#                                    cluster's image and API server), replacing another proxy
#   hack/cluster.sh proxy [NAME]     switch the service proxy to NAME: kube-userspace-proxy,
#                                    kube-proxy-iptables or kube-proxy-nftables (the previous
#                                    one's DaemonSet and rules removed first); print the current
#                                    one without NAME
#   hack/cluster.sh dns              apply CoreDNS (hack/cluster/dns) and wait until it is Ready
#   hack/cluster.sh node-stop NODE   power NODE off: SIGKILL its kubelet, containerd and pods
#                                    (its network namespace stays)
#   hack/cluster.sh node-start NODE  boot NODE again: containerd and kubelet; wait until Ready
#   hack/cluster.sh node-restart NODE  node-stop, then node-start
#   hack/cluster.sh apiserver-restart  SIGKILL kube-apiserver, start it again, wait until ready
#   hack/cluster.sh monitoring       Prometheus (built from hack/cluster/prometheus, cached) in the
#                                    control plane's namespace, scraping every node's service
#                                    proxy (job kube-proxy) and the API server (job apiserver),
#                                    with the rules of deploy/monitoring; started, or its
#                                    configuration reloaded; prints its URL on the machine
#   hack/cluster.sh prometheus-url   print that URL (fails when Prometheus does not run)
#
# Environment: KUP_CLUSTER_NAME (the prefix of its namespaces and cgroups, default kupc: clusters
# of different names run side by side), KUP_CLUSTER_DIR (state, logs, kubeconfig; default
# $XDG_CACHE_HOME/kube-userspace-proxy/cluster, or cluster-NAME for another name),
# KUP_CLUSTER_PORT (the API server on the machine's 127.0.0.1; default 16443),
# KUP_PROMETHEUS_PORT (Prometheus on the machine's 127.0.0.1; default KUP_CLUSTER_PORT + 2000),
# KUP_CLUSTER_MONITORING=1 (up starts Prometheus too, as hack/cluster.sh monitoring),
# KUP_K8S_BIN (the binaries, as make test-bins; kubectl is the one there), KUP_CLUSTER_PROXY (the
# service proxy up deploys: kube-userspace-proxy, the default, kube-proxy-iptables or
# kube-proxy-nftables).
#
# Addresses: bridge 10.77.0.0/24 (control plane .2, node-N .1N, client .100), pods of node-N
# 10.244.N.0/24, services 10.96.0.0/16 (cluster DNS 10.96.0.10, domain cluster.local),
# load-balancer IPs 10.77.1.0/24 (the client routes them to node-1).
set -euo pipefail
exec 9>&- # make test-cluster's lock: the cluster's long-lived processes must not hold it
root=$(cd "$(dirname "$0")/.." && pwd)
here=$root/hack/cluster
name=${KUP_CLUSTER_NAME:-kupc}
[[ $name =~ ^[a-z][a-z0-9]{0,7}$ ]] || { echo "cluster.sh: KUP_CLUSTER_NAME must be 1-8 lower-case letters and digits" >&2; exit 2; }
if [ "$name" = kupc ]; then
	state=${KUP_CLUSTER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kube-userspace-proxy/cluster}
else
	state=${KUP_CLUSTER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kube-userspace-proxy/cluster-$name}
fi
port=${KUP_CLUSTER_PORT:-16443}
promport=${KUP_PROMETHEUS_PORT:-$((port + 2000))}
# The pins: test/cluster.mk's, the one place they are set.
k8sversion=$(sed -n 's/^KUP_K8S_VERSION *:= *//p' "$root/test/cluster.mk")
etcdversion=$(sed -n 's/^KUP_ETCD_VERSION *:= *//p' "$root/test/cluster.mk")
export KUP_K8S_BIN=${KUP_K8S_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/kube-userspace-proxy/bin/k8s-$k8sversion-etcd-$etcdversion}
# The pinned kubectl (make test-bins builds it), never another one on PATH: no version skew.
kubectl=$KUP_K8S_BIN/kubectl
nodes=(node-1 node-2 node-3)
cpns=$name-cp
clientns=$name-client
cpip=10.77.0.2
clientip=10.77.0.100
lbrange=10.77.1.0/24
svcrange=10.96.0.0/16
dnsip=10.96.0.10
t0=$(date +%s)
step() { echo "-- [$(($(date +%s) - t0))s] $*"; }
die() { echo "cluster.sh: $*" >&2; exit 1; }

nodeidx() { echo "${1#node-}"; }
nodeip() { echo "10.77.0.1$(nodeidx "$1")"; }
nodens() { echo "$name-$1"; }
nsexists() { [ -e "/run/netns/$1" ]; }

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2; }

# ---- down ---------------------------------------------------------------------------------------

# pids_under DIR: the PIDs whose command line or executable names a path under DIR (containerd
# shims reparent to PID 1 and name their containerd's socket).
pids_under() {
	local p
	for p in /proc/[0-9]*; do
		{ tr "\0" " " <"$p/cmdline"; } 2>/dev/null | grep -qF -- "$1/" && echo "${p#/proc/}"
	done
	return 0
}

# cgroup_pids: the PIDs in every node's cgroup subtree (containers, shims, kubelet, containerd).
cgroup_pids() {
	local n f
	for n in "${nodes[@]}"; do
		for f in /sys/fs/cgroup/*/"$name-$n"; do
			[ -d "$f" ] && find "$f" -name cgroup.procs -exec cat {} + 2>/dev/null
		done
	done
	return 0
}

# killall_ours: SIGKILL every process of the cluster, by PID, until none is left.
killall_ours() {
	local i pids n
	for i in $(seq 50); do
		pids=$( (
			cgroup_pids
			[ -d "$state" ] && pids_under "$state"
			for n in "${nodes[@]}" cp client; do
				nsexists "$name-$n" && ip netns pids "$name-$n" 2>/dev/null
			done
		) | sort -u | grep -vx "$$" || true)
		[ -z "$pids" ] && return 0
		# shellcheck disable=SC2086
		kill -9 $pids 2>/dev/null || true
		sleep 0.2
	done
	echo "cluster.sh: processes left after SIGKILL: $pids" >&2
	return 1
}

down() {
	step "down: processes"
	# The kubelets first, so they restart nothing while the rest goes.
	local n f rc=0
	for n in "${nodes[@]}"; do
		f=$state/$n/kubelet.pid
		[ -s "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true
	done
	# The control plane and the forwarder (in the machine's namespace) by their PID files.
	for f in "$state"/cp/*.pid; do
		[ -s "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true
	done
	killall_ours || rc=1
	step "down: mounts, cgroups, namespaces, files"
	# Mounts made inside the nodes' mount namespaces went with their last process; anything under
	# the state directory in the machine's view (there should be none) goes too.
	if [ -d "$state" ]; then
		awk -v d="$state/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r | while read -r m; do
			umount -l "$m" || rc=1
		done
	fi
	for n in "${nodes[@]}"; do
		for f in /sys/fs/cgroup/*/"$name-$n"; do
			[ -d "$f" ] && find "$f" -depth -type d -exec rmdir {} + 2>/dev/null
			[ -d "$f" ] && { echo "cluster.sh: cgroup $f left" >&2; rc=1; }
		done
	done
	for n in "${nodes[@]}" cp client; do
		nsexists "$name-$n" && { ip netns del "$name-$n" || rc=1; }
	done
	rm -rf "$state" || rc=1
	step "down: done"
	return $rc
}

# ---- up -----------------------------------------------------------------------------------------

# certs: a CA, the API server's serving certificate, the API server's client certificate for the
# kubelets, the service-account key pair, and a token per component.
certs() {
	local pki=$state/pki
	mkdir -p "$pki"
	(
		cd "$pki"
		openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 -subj /CN=kupc-ca 2>/dev/null
		openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj /CN=kube-apiserver 2>/dev/null
		printf 'subjectAltName=IP:%s,IP:10.96.0.1,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n' "$cpip" >apiserver.ext
		openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out apiserver.crt -days 30 -extfile apiserver.ext 2>/dev/null
		openssl req -newkey rsa:2048 -nodes -keyout kubelet-client.key -out kubelet-client.csr \
			-subj "/O=system:masters/CN=kube-apiserver-kubelet-client" 2>/dev/null
		openssl x509 -req -in kubelet-client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out kubelet-client.crt -days 30 2>/dev/null
		openssl genrsa -out sa.key 2048 2>/dev/null
		openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
	)
	: >"$pki/tokens.csv"
	# NAME USER GROUP: a token per component (GROUP - for none).
	local name user group tok
	while read -r name user group; do
		tok=$(openssl rand -hex 16)
		if [ "$group" = - ]; then
			echo "$tok,$user,$name" >>"$pki/tokens.csv"
		else
			echo "$tok,$user,$name,$group" >>"$pki/tokens.csv"
		fi
		kubeconfig "$state/$name.kubeconfig" "https://$cpip:6443" "$tok"
	done <<EOF
admin admin system:masters
controller-manager system:kube-controller-manager -
scheduler system:kube-scheduler -
node-1 system:node:node-1 system:nodes
node-2 system:node:node-2 system:nodes
node-3 system:node:node-3 system:nodes
lbctl system:kup-lbctl -
EOF
	# The machine's kubeconfig: the admin through the loopback forwarder.
	kubeconfig "$state/kubeconfig" "https://127.0.0.1:$port" "$(awk -F, '$2 == "admin" {print $1}' "$pki/tokens.csv")"
	chmod 600 "$pki"/*.key "$pki/tokens.csv" "$state"/*.kubeconfig "$state/kubeconfig"
}

# kubeconfig FILE SERVER TOKEN
kubeconfig() {
	cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kup-local
  cluster:
    server: $2
    certificate-authority: $state/pki/ca.crt
users:
- name: kup-local
  user:
    token: $3
contexts:
- name: kup-local
  context: {cluster: kup-local, user: kup-local}
current-context: kup-local
EOF
}

network() {
	ip netns add "$cpns"
	ip -n "$cpns" link set lo up
	ip -n "$cpns" link add br0 type bridge
	ip -n "$cpns" addr add "$cpip/24" dev br0
	ip -n "$cpns" link set br0 up
	local n ns m
	for n in "${nodes[@]}" client; do
		ns=$name-$n
		ip netns add "$ns"
		ip -n "$ns" link set lo up
		# Created inside the control plane's namespace, never in the machine's.
		ip -n "$cpns" link add "v-$n" type veth peer name eth0 netns "$ns"
		ip -n "$cpns" link set "v-$n" master br0 up
		ip -n "$ns" link set eth0 up
	done
	for n in "${nodes[@]}"; do
		ns=$name-$n
		ip -n "$ns" addr add "$(nodeip "$n")/24" dev eth0
		ip netns exec "$ns" sysctl -qw net.ipv4.ip_forward=1
		# Locally generated packets to a ClusterIP are routed before OUTPUT's DNAT: they need a route.
		ip -n "$ns" route add default via "$cpip"
		for m in "${nodes[@]}"; do
			[ "$m" = "$n" ] && continue
			ip -n "$ns" route add "10.244.$(nodeidx "$m").0/24" via "$(nodeip "$m")"
		done
		nodeip "$n" >"$state/$n/ip"
	done
	ip -n "$clientns" addr add "$clientip/24" dev eth0
	ip -n "$clientns" route add "$lbrange" via "$(nodeip node-1)"
	# The API server reaches pods (its proxy subresource, webhooks) as a node's kubelet would.
	for n in "${nodes[@]}"; do
		ip -n "$cpns" route add "10.244.$(nodeidx "$n").0/24" via "$(nodeip "$n")"
	done
}

control_plane() {
	local cp=$state/cp pki=$state/pki
	mkdir -p "$cp"
	# setsid: the components outlive this script; down finds them by PID.
	ip netns exec "$cpns" setsid "$KUP_K8S_BIN/etcd" --name default --data-dir "$cp/etcd" --unsafe-no-fsync \
		--listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
		--listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
		--initial-cluster default=http://127.0.0.1:2380 --log-level warn >"$cp/etcd.log" 2>&1 </dev/null &
	echo $! >"$cp/etcd.pid"
	ip netns exec "$cpns" setsid "$KUP_K8S_BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
		--bind-address=0.0.0.0 --secure-port=6443 --advertise-address="$cpip" \
		--tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
		--client-ca-file="$pki/ca.crt" --token-auth-file="$pki/tokens.csv" \
		--service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
		--service-account-issuer=https://kubernetes.default.svc.cluster.local \
		--authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
		--service-cluster-ip-range="$svcrange" --allow-privileged=true \
		--kubelet-client-certificate="$pki/kubelet-client.crt" --kubelet-client-key="$pki/kubelet-client.key" \
		--kubelet-preferred-address-types=InternalIP --profiling=false \
		--cert-dir="$cp/apiserver-certs" >"$cp/kube-apiserver.log" 2>&1 </dev/null &
	echo $! >"$cp/kube-apiserver.pid"
	# The machine reaches the API server only through this: a listener on its loopback that
	# connects from inside the control plane's namespace.
	setsid socat "TCP-LISTEN:$port,bind=127.0.0.1,reuseaddr,fork" \
		"EXEC:ip netns exec $cpns socat STDIO TCP\\:$cpip\\:6443" >"$cp/forward.log" 2>&1 </dev/null &
	echo $! >"$cp/forward.pid"
	local i
	for i in $(seq 120); do
		KUBECONFIG=$state/kubeconfig "$kubectl" --request-timeout=2s get --raw /readyz >/dev/null 2>&1 && break
		kill -0 "$(cat "$cp/kube-apiserver.pid")" 2>/dev/null || die "kube-apiserver exited; see $cp/kube-apiserver.log"
		kill -0 "$(cat "$cp/forward.pid")" 2>/dev/null || die "the forwarder on 127.0.0.1:$port exited (port taken? set KUP_CLUSTER_PORT); see $cp/forward.log"
		[ "$i" = 120 ] && die "kube-apiserver not ready in 60 s; see $cp/kube-apiserver.log"
		sleep 0.5
	done
	step "API server ready"
	ip netns exec "$cpns" setsid "$KUP_K8S_BIN/kube-controller-manager" --kubeconfig="$state/controller-manager.kubeconfig" \
		--leader-elect=false --use-service-account-credentials=true \
		--service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
		--flex-volume-plugin-dir="$cp/flex" --bind-address=127.0.0.1 \
		--cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
		>"$cp/kube-controller-manager.log" 2>&1 </dev/null &
	echo $! >"$cp/kube-controller-manager.pid"
	ip netns exec "$cpns" setsid "$KUP_K8S_BIN/kube-scheduler" --kubeconfig="$state/scheduler.kubeconfig" \
		--leader-elect=false --bind-address=127.0.0.1 >"$cp/kube-scheduler.log" 2>&1 </dev/null &
	echo $! >"$cp/kube-scheduler.pid"
}

# lb_controller: lbctl (hack/cluster/lbctl) gives every LoadBalancer Service an address of
# $lbrange in its status, as a cloud's controller does; it runs in the control plane's namespace
# as the user system:kup-lbctl (its token from certs, its RBAC hack/cluster/lbctl/rbac.yaml).
# down kills it with the control plane (cp/lbctl.pid).
lb_controller() {
	local cp=$state/cp
	(cd "$root" && "${GO:-go}" build -o "$cp/lbctl" ./hack/cluster/lbctl) || die "building hack/cluster/lbctl failed"
	k apply -f "$here/lbctl/rbac.yaml" >/dev/null
	ip netns exec "$cpns" setsid "$cp/lbctl" --kubeconfig="$state/lbctl.kubeconfig" --pool="$lbrange" \
		>"$cp/lbctl.log" 2>&1 </dev/null &
	echo $! >"$cp/lbctl.pid"
}

node_config() {
	local n=$1 d=$state/$1 i
	i=$(nodeidx "$n")
	mkdir -p "$d/cni/net.d" "$d/containerd" "$d/runc" "$d/var" "$d/pki" "$d/volume-plugins"
	cp "$state/$n.kubeconfig" "$d/kubelet.kubeconfig"
	cat >"$d/containerd.toml" <<EOF
version = 2
root = "$d/containerd/root"
state = "$d/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$d/containerd.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$d/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "kup-pause:dev"
  # No CAP_SYS_RESOURCE here: runc could not lower a container's OOM score below its own.
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "$d/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$d/cni/net.d"
EOF
	cat >"$d/cni/net.d/10-kupc.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "kupc",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.$i.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
	cat >"$d/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 here; the node's own cgroup subtree (hack/cluster/node.sh creates it).
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /$name-$n
containerRuntimeEndpoint: unix://$d/containerd.sock
# No CAP_SYS_RESOURCE: the kubelet cannot give itself -999.
oomScoreAdj: 0
protectKernelDefaults: false
failSwapOn: false
resolvConf: ""
clusterDNS: [$dnsip]
clusterDomain: cluster.local
address: $(nodeip "$n")
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
volumePluginDir: $d/volume-plugins
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $state/pki/ca.crt}
authorization:
  mode: Webhook
# The imported images are all there is: never collect them; evict on nothing but memory.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
serializeImagePulls: false
nodeStatusReportFrequency: 10s
shutdownGracePeriod: 0s
EOF
}

start_node() {
	local n=$1
	rm -f "$state/$n/started"
	# A UTS namespace of the node's own: its hostname is the node's name, as hostNetwork pods
	# (which share it) see it on a real node.
	ip netns exec "$(nodens "$n")" unshare --uts setsid "$here/node.sh" "$state" "$n" "$name" >"$state/$n/node.log" 2>&1 </dev/null &
}

# node_pids NODE: the PIDs of a node's processes: its cgroup subtree holds all of them (node.sh
# put itself there, so containerd, the kubelet, the shims and the containers are its descendants).
node_pids() {
	local f
	for f in /sys/fs/cgroup/*/"$name-$1"; do
		[ -d "$f" ] && find "$f" -name cgroup.procs -exec cat {} + 2>/dev/null
	done
	return 0
}

# node_stop NODE: the node's power goes off: SIGKILL to the kubelet, then to every process of the
# node until none is left. Its network namespace (addresses, routes, the CNI bridge, iptables)
# stays; its mount namespace, containers and their network namespaces go with their processes.
node_stop() {
	local n=$1 d=$state/$1 i pids
	[ -d "$d" ] || die "no node $n (node-1 .. node-3)"
	[ -s "$d/kubelet.pid" ] && kill -9 "$(cat "$d/kubelet.pid")" 2>/dev/null || true
	for i in $(seq 50); do
		pids=$(node_pids "$n" | sort -u | grep -vx "$$" || true)
		[ -z "$pids" ] && break
		# shellcheck disable=SC2086
		kill -9 $pids 2>/dev/null || true
		sleep 0.2
	done
	[ -z "$pids" ] || die "$n: processes left after SIGKILL: $pids"
	rm -f "$d/node.pid" "$d/kubelet.pid" "$d/containerd.pid" "$d/started"
	step "$n stopped"
}

# node_start NODE: the node boots: containerd and the kubelet again (hack/cluster/node.sh), in a
# new mount namespace on the same /var; waits until the kubelet runs and the node is Ready.
node_start() {
	local n=$1 d=$state/$1 i
	[ -d "$d" ] || die "no node $n (node-1 .. node-3)"
	[ -s "$d/node.pid" ] && kill -0 "$(cat "$d/node.pid")" 2>/dev/null && die "$n is running (node-stop first)"
	start_node "$n"
	for i in $(seq 240); do
		[ -e "$d/started" ] && [ "$(k get node "$n" --no-headers 2>/dev/null | awk '{print $2}')" = Ready ] && break
		[ "$i" -gt 10 ] && { [ -s "$d/node.pid" ] && kill -0 "$(cat "$d/node.pid")" 2>/dev/null || die "$n stopped; see $d/node.log, kubelet.log, containerd.log"; }
		[ "$i" = 240 ] && die "$n not Ready in 120 s; see $d/kubelet.log"
		sleep 0.5
	done
	step "$n started and Ready"
}

# apiserver_restart: SIGKILL kube-apiserver, start it again with the same command line, wait
# until it is ready.
apiserver_restart() {
	local cp=$state/cp pid i args=()
	pid=$(cat "$cp/kube-apiserver.pid")
	mapfile -d '' args <"/proc/$pid/cmdline" || die "kube-apiserver $pid is not running"
	kill -9 "$pid" 2>/dev/null || true
	for i in $(seq 100); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	kill -0 "$pid" 2>/dev/null && die "kube-apiserver $pid did not exit"
	step "kube-apiserver killed"
	echo "-- restarted $(date -u +%FT%TZ)" >>"$cp/kube-apiserver.log"
	ip netns exec "$cpns" setsid "${args[@]}" >>"$cp/kube-apiserver.log" 2>&1 </dev/null &
	echo $! >"$cp/kube-apiserver.pid"
	for i in $(seq 120); do
		k --request-timeout=2s get --raw /readyz >/dev/null 2>&1 && break
		kill -0 "$(cat "$cp/kube-apiserver.pid")" 2>/dev/null || die "kube-apiserver exited; see $cp/kube-apiserver.log"
		[ "$i" = 120 ] && die "kube-apiserver not ready in 60 s; see $cp/kube-apiserver.log"
		sleep 0.5
	done
	step "kube-apiserver ready"
}

# k ARGS...: the pinned kubectl with the cluster's kubeconfig.
k() { KUBECONFIG=$state/kubeconfig "$kubectl" "$@"; }

# ---- phases of up -------------------------------------------------------------------------------

phases=()
phase_name=
phase_t=
# phase NAME: the next phase of up; its duration goes into the summary.
phase() {
	phase_end
	phase_name=$1
	phase_t=$(date +%s)
	step "$1"
}
phase_end() {
	[ -z "$phase_name" ] || phases+=("$(printf '%-12s %5ss' "$phase_name" $(($(date +%s) - phase_t)))")
	phase_name=
}

# missing_deps: what up needs and does not find, one a line.
missing_deps() {
	local c
	for c in containerd runc ctr socat openssl docker ip nsenter unshare hostname setsid flock iptables nft conntrack curl; do
		command -v "$c" >/dev/null || echo "$c"
	done
	[ -x /usr/lib/cni/bridge ] || echo "/usr/lib/cni/bridge (containernetworking-plugins)"
	command -v "${GO:-go}" >/dev/null || echo "${GO:-go} (Go)"
	return 0
}

# deps: everything up needs, checked before anything is built or started; what is missing is
# installed by hack/install-deps.sh (Debian packages) or named.
deps() {
	[ "$(id -u)" = 0 ] || die "needs root (network and mount namespaces)"
	local missing
	missing=$(missing_deps | paste -sd' ')
	if [ -n "$missing" ]; then
		step "missing: $missing; installing (hack/install-deps.sh)"
		"$root/hack/install-deps.sh" || die "hack/install-deps.sh failed; missing: $missing"
		missing=$(missing_deps | paste -sd' ')
		[ -z "$missing" ] || die "still missing after hack/install-deps.sh: $missing"
	fi
	docker info >/dev/null 2>&1 || die "docker does not answer (docker info): the cluster's images are built with it"
	proxy_dir "$proxy" >/dev/null || die "KUP_CLUSTER_PROXY (make cluster PROXY=...) is $proxy: want one of $proxy_names"
}

# binaries: the pinned Kubernetes binaries, etcd and kubectl (make test-bins), and CoreDNS.
binaries() {
	GO=${GO:-go} "$root/test/k8sbin/build.sh" "$KUP_K8S_BIN" "$k8sversion" "$etcdversion"
	local dir
	dir=$("$here/coredns.sh" --dir)
	KUP_COREDNS=$(GO=${GO:-go} "$here/coredns.sh" "$dir" | tail -n 1)
	export KUP_COREDNS
	echo "coredns: $KUP_COREDNS ($("$KUP_COREDNS" -version | head -1))"
}

up() {
	proxy=${KUP_CLUSTER_PROXY:-kube-userspace-proxy}
	phase dependencies
	deps
	if nsexists "$cpns" || [ -e "$state" ]; then
		if [ -s "$state/up" ] && [ -x "$kubectl" ] && k --request-timeout=3s get --raw /readyz >/dev/null 2>&1; then
			step "the cluster is up already"
			phase proxy
			use_proxy "$proxy"
			phase dns
			dns
			[ "${KUP_CLUSTER_MONITORING:-}" != 1 ] || { phase monitoring; monitoring; }
			summary
			return 0
		fi
		step "a previous cluster is left (failed or stopped): removing it"
		down
	fi
	if ss -Hltn "sport = :$port" 2>/dev/null | grep -q .; then
		die "127.0.0.1:$port is taken: set KUP_CLUSTER_PORT"
	fi
	phase binaries
	binaries
	mkdir -p "$state"
	for n in "${nodes[@]}"; do mkdir -p "$state/$n"; done
	phase images
	"$here/images.sh" "$state/images.tar"
	phase cluster
	step "certificates and tokens in $state/pki"
	certs
	step "network namespaces"
	network
	step "control plane"
	control_plane
	step "load-balancer addresses (lbctl)"
	lb_controller
	step "nodes"
	for n in "${nodes[@]}"; do
		node_config "$n"
		start_node "$n"
	done
	local i
	for i in $(seq 240); do
		local ready
		ready=$(k get nodes --no-headers 2>/dev/null | awk '$2 == "Ready"' | wc -l)
		[ "$ready" = "${#nodes[@]}" ] && break
		for c in etcd kube-apiserver kube-controller-manager kube-scheduler; do
			kill -0 "$(cat "$state/cp/$c.pid")" 2>/dev/null || die "$c exited; see $state/cp/$c.log"
		done
		for n in "${nodes[@]}"; do
			kill -0 "$(cat "$state/$n/node.pid" 2>/dev/null || echo 0)" 2>/dev/null ||
				[ ! -e "$state/$n/node.pid" ] || die "$n stopped; see $state/$n/node.log, kubelet.log, containerd.log"
		done
		[ "$i" = 240 ] && die "nodes not Ready in 120 s; see $state/node-*/kubelet.log"
		sleep 0.5
	done
	date +%s >"$state/up"
	step "3 nodes Ready"
	phase proxy
	use_proxy "$proxy"
	phase dns
	dns
	[ "${KUP_CLUSTER_MONITORING:-}" != 1 ] || { phase monitoring; monitoring; }
	summary
}

summary() {
	phase_end
	echo
	echo "The cluster is up, $(($(date +%s) - t0))s; service proxy $(current_proxies | paste -sd' '), CoreDNS at $dnsip:"
	printf '  %s\n' "${phases[@]}"
	usage_hint
}

usage_hint() {
	cat <<HINT

State and logs: $state. kubectl: $kubectl (the pinned one).
  export KUBECONFIG=$state/kubeconfig
  $kubectl get nodes -o wide
  hack/cluster.sh kubectl get pods -A         # the same with the cluster's kubeconfig
  hack/cluster.sh proxy kube-proxy-nftables   # switch the service proxy (or kube-proxy-iptables, kube-userspace-proxy)
  hack/cluster.sh exec node-1 ip route        # in a node's namespace
  hack/cluster.sh client curl ...             # from outside the cluster
  hack/cluster.sh monitoring                  # Prometheus scraping the proxies and the API server
  make cluster-down                           # remove everything
HINT
}

# ---- the service proxy and DNS ------------------------------------------------------------------

proxy_names="kube-userspace-proxy kube-proxy-iptables kube-proxy-nftables"

# proxy_dir NAME: the kustomization that deploys service proxy NAME.
proxy_dir() {
	case $1 in
	kube-userspace-proxy) echo "$here/deploy" ;;
	kube-proxy-iptables) echo "$here/kube-proxy/iptables" ;;
	kube-proxy-nftables) echo "$here/kube-proxy/nftables" ;;
	*) return 1 ;;
	esac
}

# proxy_ds NAME: the DaemonSet of service proxy NAME.
proxy_ds() {
	case $1 in
	kube-userspace-proxy) echo kube-userspace-proxy ;;
	*) echo kube-proxy ;;
	esac
}

# proxy_selector NAME: the label selector of service proxy NAME's pods.
proxy_selector() {
	case $1 in
	kube-userspace-proxy) echo app.kubernetes.io/name=kube-userspace-proxy ;;
	*) echo k8s-app=kube-proxy ;;
	esac
}

# current_proxies: the service proxies whose DaemonSet is there, one a line.
current_proxies() {
	local ds mode
	ds=$(k -n kube-system get daemonset kube-userspace-proxy --ignore-not-found -o name) || die "kubectl get daemonset failed"
	[ -z "$ds" ] || echo kube-userspace-proxy
	ds=$(k -n kube-system get daemonset kube-proxy --ignore-not-found -o name) || die "kubectl get daemonset failed"
	if [ -n "$ds" ]; then
		mode=$(k -n kube-system get configmap kube-proxy --ignore-not-found -o jsonpath='{.data.config\.conf}' | sed -n 's/^mode: *//p')
		echo "kube-proxy-${mode:-iptables}"
	fi
}

# use_proxy NAME: service proxy NAME on every node, and no other: the others' DaemonSets are
# deleted (their pods stopped) and their rules removed on every node before NAME is applied.
use_proxy() {
	local want=$1 dir ds cur
	dir=$(proxy_dir "$want") || die "no service proxy $want: want one of $proxy_names"
	for cur in $(current_proxies); do
		[ "$cur" = "$want" ] || remove_proxy "$cur"
	done
	ds=$(proxy_ds "$want")
	step "proxy: $want (kubectl apply -k ${dir#"$root"/})"
	k apply -k "$dir" >/dev/null
	k -n kube-system rollout status "daemonset/$ds" --timeout=150s >/dev/null ||
		die "the $ds DaemonSet did not roll out in 150 s: see hack/cluster.sh kubectl -n kube-system describe daemonset $ds"
	local i ready
	for i in $(seq 120); do
		ready=$(k -n kube-system get daemonset "$ds" -o jsonpath='{.status.numberReady} {.status.desiredNumberScheduled} {.status.updatedNumberScheduled}')
		[ "$ready" = "${#nodes[@]} ${#nodes[@]} ${#nodes[@]}" ] && break
		[ "$i" = 120 ] && die "the $ds DaemonSet: ready, desired, updated $ready after 60 s"
		sleep 0.5
	done
	step "proxy: $want Ready on ${#nodes[@]} nodes"
}

# cleanup_pods IMAGE COMMAND: a pod on every node that runs COMMAND (a JSON list) from IMAGE in
# the node's network namespace, privileged, once.
cleanup_pods() {
	local n
	for n in "${nodes[@]}"; do
		cat <<POD
---
apiVersion: v1
kind: Pod
metadata:
  name: proxy-cleanup-$n
  namespace: kube-system
  labels: {app.kubernetes.io/name: proxy-cleanup}
spec:
  nodeName: $n
  hostNetwork: true
  restartPolicy: Never
  priorityClassName: system-node-critical
  tolerations: [{operator: Exists}]
  containers:
  - name: cleanup
    image: $1
    imagePullPolicy: Never
    command: $2
    securityContext: {privileged: true}
    volumeMounts: [{name: xtables-lock, mountPath: /run/xtables.lock}]
  volumes: [{name: xtables-lock, hostPath: {path: /run/xtables.lock, type: FileOrCreate}}]
POD
	done
}

# remove_proxy NAME: deletes service proxy NAME's DaemonSet, then its pods with a short grace
# period (connections through it do not survive a switch anyway: ours removes its rules at once
# on SIGTERM and would drain for 30 s), then runs NAME's own cleanup (kube-proxy --cleanup,
# kube-userspace-proxy --cleanup) from its image on every node, so that none of its rules is
# left, then deletes the rest of its objects.
remove_proxy() {
	local name=$1 ds image cmd n i got want
	ds=$(proxy_ds "$name")
	image=$(k -n kube-system get daemonset "$ds" -o jsonpath='{.spec.template.spec.containers[0].image}')
	step "proxy: removing $name (DaemonSet $ds)"
	k -n kube-system delete daemonset "$ds" --cascade=orphan >/dev/null || die "deleting the $ds DaemonSet failed"
	k -n kube-system delete pods -l "$(proxy_selector "$name")" --grace-period=5 --timeout=120s >/dev/null ||
		die "deleting the pods of $name failed"
	case $name in
	kube-userspace-proxy) cmd='["/usr/local/bin/kube-userspace-proxy", "--cleanup"]' ;;
	*) cmd='["/usr/local/bin/kube-proxy", "--cleanup"]' ;;
	esac
	k -n kube-system delete pods -l app.kubernetes.io/name=proxy-cleanup --ignore-not-found --timeout=60s >/dev/null
	cleanup_pods "$image" "$cmd" | k apply -f - >/dev/null
	want=$(for n in "${nodes[@]}"; do echo Succeeded; done | paste -sd' ')
	for i in $(seq 240); do
		got=$(k -n kube-system get pods -l app.kubernetes.io/name=proxy-cleanup -o jsonpath='{range .items[*]}{.status.phase}{"\n"}{end}' | paste -sd' ')
		case $got in *Failed*) break ;; esac
		[ "$got" = "$want" ] && break
		sleep 0.5
	done
	if [ "$got" != "$want" ]; then
		for n in "${nodes[@]}"; do
			echo "== proxy-cleanup-$n:" >&2
			k -n kube-system logs "proxy-cleanup-$n" >&2 || true
		done
		k -n kube-system delete pods -l app.kubernetes.io/name=proxy-cleanup --wait=false >/dev/null || true
		die "the cleanup of $name did not succeed on every node (pods: $got)"
	fi
	k -n kube-system delete pods -l app.kubernetes.io/name=proxy-cleanup --timeout=60s >/dev/null
	k delete -k "$(proxy_dir "$name")" --ignore-not-found >/dev/null
	step "proxy: $name removed, its rules cleaned up on ${#nodes[@]} nodes"
}

# dns: CoreDNS (hack/cluster/dns) applied and Ready.
dns() {
	step "dns: CoreDNS (kubectl apply -f hack/cluster/dns/coredns.yaml)"
	k apply -f "$here/dns/coredns.yaml" >/dev/null
	k -n kube-system rollout status deployment/coredns --timeout=150s >/dev/null ||
		die "CoreDNS did not roll out in 150 s: see hack/cluster.sh kubectl -n kube-system describe deployment coredns"
	step "dns: CoreDNS Ready at $dnsip"
}

# ---- monitoring ---------------------------------------------------------------------------------

# prometheus_running: whether the cluster's Prometheus runs.
prometheus_running() {
	[ -s "$state/cp/prometheus.pid" ] && kill -0 "$(cat "$state/cp/prometheus.pid")" 2>/dev/null
}

# monitoring: Prometheus in the control plane's namespace (listening on $cpip:9090 and its
# loopback there), reached from the machine through a loopback forwarder on 127.0.0.1:$promport.
# It reads the service proxies' pods and the API server's /metrics as the ServiceAccount
# monitoring/prometheus (hack/cluster/monitoring/rbac.yaml), and evaluates the rule files of
# deploy/monitoring (copied to $state/monitoring/rules). When it runs already, the configuration
# and rules are written anew and reloaded. down stops it with the control plane (cp/*.pid); its
# data ($state/monitoring/data) goes with the state directory.
monitoring() {
	local m=$state/monitoring cp=$state/cp dir bin i tok
	dir=$("$here/prometheus.sh" --dir)
	bin=$(GO=${GO:-go} "$here/prometheus.sh" "$dir" | tail -n 1) || die "building Prometheus failed"
	mkdir -p "$m/rules" "$m/data"
	k apply -f "$here/monitoring/rbac.yaml" >/dev/null
	for i in $(seq 60); do
		tok=$(k -n monitoring get secret prometheus-token -o jsonpath='{.data.token}' 2>/dev/null || true)
		[ -n "$tok" ] && break
		[ "$i" = 60 ] && die "the Secret monitoring/prometheus-token has no token after 30 s (kube-controller-manager's token controller)"
		sleep 0.5
	done
	(umask 077 && echo "$tok" | base64 -d >"$m/token")
	rm -f "$m/rules"/*.yaml
	cp "$root/deploy/monitoring/kubernetes-mixin/kube-proxy-alerts.yaml" "$m/rules/kubernetes-mixin-kube-proxy-alerts.yaml"
	cp "$root/deploy/monitoring/kube-userspace-proxy-rules.yaml" "$m/rules/"
	sed "s|@STATE@|$state|g" "$here/monitoring/prometheus.yml" >"$m/prometheus.yml"
	if prometheus_running; then
		ip netns exec "$cpns" curl -fsS -X POST "http://127.0.0.1:9090/-/reload" >/dev/null ||
			die "Prometheus did not reload its configuration; see $m/prometheus.log"
		step "monitoring: Prometheus reloaded its configuration and rules"
	else
		ip netns exec "$cpns" setsid "$bin" --config.file="$m/prometheus.yml" --storage.tsdb.path="$m/data" \
			--storage.tsdb.retention.time=2d --web.listen-address=0.0.0.0:9090 --web.enable-lifecycle \
			>"$m/prometheus.log" 2>&1 </dev/null &
		echo $! >"$cp/prometheus.pid"
	fi
	if ! { [ -s "$cp/prometheus-forward.pid" ] && kill -0 "$(cat "$cp/prometheus-forward.pid")" 2>/dev/null; }; then
		ss -Hltn "sport = :$promport" 2>/dev/null | grep -q . && die "127.0.0.1:$promport is taken: set KUP_PROMETHEUS_PORT"
		setsid socat "TCP-LISTEN:$promport,bind=127.0.0.1,reuseaddr,fork" \
			"EXEC:ip netns exec $cpns socat STDIO TCP\\:$cpip\\:9090" >"$m/forward.log" 2>&1 </dev/null &
		echo $! >"$cp/prometheus-forward.pid"
	fi
	for i in $(seq 120); do
		curl -fsS "http://127.0.0.1:$promport/-/ready" >/dev/null 2>&1 && break
		prometheus_running || die "Prometheus exited; see $m/prometheus.log"
		[ "$i" = 120 ] && die "Prometheus not ready in 60 s; see $m/prometheus.log, $m/forward.log"
		sleep 0.5
	done
	echo "$promport" >"$m/port"
	step "monitoring: Prometheus $("$bin" --version 2>/dev/null | head -1 | awk '{print $3}') ready at http://127.0.0.1:$promport (the HTTP API, e.g. /api/v1/targets; the Go build has no web UI)"
}

# ---- the rest -----------------------------------------------------------------------------------

need_up() { [ -s "$state/up" ] || die "the cluster is not up (hack/cluster.sh up)"; }

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
up) up ;;
down) down ;;
status)
	if [ -s "$state/up" ]; then
		k get nodes -o wide && k get pods -A -o wide
		echo "service proxy: $(current_proxies | paste -sd' ')"
	else
		echo down
	fi
	;;
kubeconfig) need_up; echo "$state/kubeconfig" ;;
kubectl) need_up; KUBECONFIG=$state/kubeconfig exec "$kubectl" "$@" ;;
exec)
	need_up
	n=${1:?usage: hack/cluster.sh exec NODE CMD...}
	shift
	[ -s "$state/$n/node.pid" ] || die "no node $n (node-1 .. node-3)"
	exec nsenter -t "$(cat "$state/$n/node.pid")" -m -n -u -- "$@"
	;;
client) need_up; exec ip netns exec "$clientns" "$@" ;;
images)
	need_up
	binaries
	"$here/images.sh" "$state/images.tar"
	for n in "${nodes[@]}"; do
		ctr -a "$state/$n/containerd.sock" -n k8s.io images import "$state/images.tar" >/dev/null
	done
	;;
deploy) need_up; use_proxy kube-userspace-proxy ;;
proxy)
	need_up
	if [ $# = 0 ]; then
		current_proxies
	else
		use_proxy "$1"
	fi
	;;
dns) need_up; dns ;;
node-stop) need_up; node_stop "${1:?usage: hack/cluster.sh node-stop NODE}" ;;
node-start) need_up; node_start "${1:?usage: hack/cluster.sh node-start NODE}" ;;
node-restart)
	need_up
	node_stop "${1:?usage: hack/cluster.sh node-restart NODE}"
	node_start "$1"
	;;
apiserver-restart) need_up; apiserver_restart ;;
monitoring) need_up; monitoring ;;
prometheus-url)
	need_up
	prometheus_running || die "Prometheus does not run (hack/cluster.sh monitoring)"
	echo "http://127.0.0.1:$(cat "$state/monitoring/port")"
	;;
*) usage ;;
esac
