#!/usr/bin/env bash
# images.sh: the images Kubernetes' end-to-end suite runs for sig-network, built on this machine
# (no registry) and tagged with the exact names `e2e.test --list-images` prints, then imported
# into every node of the running local cluster (KUP_CLUSTER_NAME, as hack/cluster.sh), so that
# the kubelets, whose pull policy is IfNotPresent for tags other than :latest, never pull.
#
#   registry.k8s.io/e2e-test-images/agnhost:2.63.0      agnhost (make e2e-bins) on a Debian base
#       with the tools the tests exec in it: curl, nc (netcat-openbsd: -u -v -z), dig and
#       nslookup, wget, ip and ss, ps, seq, sh; /coredns (for the custom-DNS-server test), the
#       porter's localhost.crt/.key, /agnhost-2, /uploads, uid 1000 in gid 50000, as upstream's
#   registry.k8s.io/e2e-test-images/glibc-dns-testing:2.0.0   the same Debian base (dig, glibc)
#   registry.k8s.io/e2e-test-images/busybox:1.37.0-1    Debian's busybox-static, its applets in /bin
#   registry.k8s.io/e2e-test-images/nginx:1.15-4        Debian's nginx-light on port 80
#   registry.k8s.io/e2e-test-images/regression-issue-74839:1.4   built from the suite's source
#   registry.k8s.io/build-image/distroless-iptables:v0.9.6       iptables, conntrack, sleep
#   registry.k8s.io/pause:3.10.2                         hack/cluster/pause
#
# The Debian base is demo/base-image.sh's debootstrap with the packages above added
# (kup-e2e-base:bookworm; built once, minutes cold). Needs root, Docker, ctr, the cluster up.
#   hack/conformance/images.sh                        build, save, import (skipped when every node
#                                                     has every image: --force rebuilds)
#   hack/conformance/images.sh --save-only ARCHIVE    build and save them, import nothing
#   hack/conformance/images.sh --import ARCHIVE       import a saved ARCHIVE into every node
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
GO=${GO:-go}
save_only= import= force=
case ${1:-} in
--save-only) save_only=${2:?usage: images.sh --save-only ARCHIVE} ;;
--import) import=${2:?usage: images.sh --import ARCHIVE} ;;
--force) force=1 ;;
'') ;;
*) echo "usage: images.sh [--force | --save-only ARCHIVE | --import ARCHIVE]" >&2; exit 2 ;;
esac
t0=$(date +%s)
step() { echo "-- images [$(($(date +%s) - t0))s] $*"; }
die() { echo "images.sh: $*" >&2; exit 1; }

k8sversion=$(sed -n 's/^KUP_K8S_VERSION *:= *//p' "$root/test/cluster.mk")
etcdversion=$(sed -n 's/^KUP_ETCD_VERSION *:= *//p' "$root/test/cluster.mk")
bin=${KUP_K8S_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/kube-userspace-proxy/bin/k8s-$k8sversion-etcd-$etcdversion}
for b in agnhost regression-issue-74839; do
	[ -x "$bin/$b" ] || die "$bin/$b not found: run make e2e-bins"
done
state=
if [ -z "$save_only" ]; then
	state=$(dirname "$("$root/hack/cluster.sh" kubeconfig)") || die "the cluster is not up (make cluster)"
fi

# The upstream names, as e2e.test --list-images prints them.
reg=registry.k8s.io/e2e-test-images
agnhost=$reg/agnhost:2.63.0
glibcdns=$reg/glibc-dns-testing:2.0.0
busybox=$reg/busybox:1.37.0-1
nginx=$reg/nginx:1.15-4
regression=$reg/regression-issue-74839:1.4
iptables=registry.k8s.io/build-image/distroless-iptables:v0.9.6
pause=registry.k8s.io/pause:3.10.2
all=("$agnhost" "$glibcdns" "$busybox" "$nginx" "$regression" "$iptables" "$pause")

nodes=(node-1 node-2 node-3)
# import_into_nodes ARCHIVE: ctr import into every node's containerd (names kept).
import_into_nodes() {
	local n
	for n in "${nodes[@]}"; do
		step "importing into $n"
		ctr -a "$state/$n/containerd.sock" -n k8s.io images import "$1" >/dev/null
	done
}
if [ -n "$import" ]; then
	import_into_nodes "$import"
	step "done"
	exit 0
fi
# every_node_has_them: whether every node's containerd holds every image.
every_node_has_them() {
	local n have i
	for n in "${nodes[@]}"; do
		have=$(ctr -a "$state/$n/containerd.sock" -n k8s.io images ls -q 2>/dev/null) || return 1
		for i in "${all[@]}"; do
			grep -qxF "$i" <<<"$have" || return 1
		done
	done
}
if [ -z "$save_only" ] && [ -z "$force" ] && every_node_has_them; then
	step "every node has the suite's images (--force rebuilds them)"
	exit 0
fi

# Docker's tags are the machine's: one build-and-save at a time (as hack/cluster/images.sh).
lock=${XDG_CACHE_HOME:-$HOME/.cache}/kube-userspace-proxy/images.lock
mkdir -p "$(dirname "$lock")"
exec 8>"$lock"
flock 8

base=kup-e2e-base:bookworm
step "base image $base"
KUP_BASE_EXTRA=curl,netcat-openbsd,dnsutils,wget,procps,busybox-static,nginx-light \
	"$root/demo/base-image.sh" "$base"

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
# build DIR TAG...: docker build of DIR, its output shown only when it fails.
build() {
	local dir=$1 args=()
	shift
	for t in "$@"; do args+=(-t "$t"); done
	docker build -q "${args[@]}" "$dir" >"$ctx/build.log" 2>&1 || { cat "$ctx/build.log" >&2; return 1; }
}

k8sdir=$(cd "$root/test/e2ebin" && GOWORK=off "$GO" list -m -f '{{.Dir}}' k8s.io/kubernetes)

step "agnhost"
mkdir "$ctx/agnhost"
cp "$bin/agnhost" "$ctx/agnhost/"
cp "$k8sdir/test/images/agnhost/porter/localhost.crt" "$k8sdir/test/images/agnhost/porter/localhost.key" "$ctx/agnhost/"
# /coredns answers the custom DNS server test (plugins hosts and log): the cluster's own CoreDNS
# build (hack/cluster/coredns.sh), which has them.
if [ -x "$root/hack/cluster/coredns.sh" ]; then
	coredns=$(GO="$GO" "$root/hack/cluster/coredns.sh" "$("$root/hack/cluster/coredns.sh" --dir)" | tail -n 1)
	cp "$coredns" "$ctx/agnhost/coredns"
else
	echo "images.sh: no hack/cluster/coredns.sh: agnhost without /coredns" >&2
	printf '#!/bin/sh\necho "no coredns in this image" >&2; exit 1\n' >"$ctx/agnhost/coredns"
	chmod 0755 "$ctx/agnhost/coredns"
fi
chmod 0644 "$ctx/agnhost/localhost.key"
cat >"$ctx/agnhost/Dockerfile" <<DF
FROM $base
COPY agnhost coredns localhost.crt localhost.key /
RUN ln -s agnhost /agnhost-2 && mkdir /uploads \
 && groupadd -g 50000 group-defined-in-image \
 && useradd -u 1000 -M -G group-defined-in-image user-defined-in-image
EXPOSE 80 8080 8081 9376 5000
ENTRYPOINT ["/agnhost"]
CMD ["pause"]
DF
build "$ctx/agnhost" "$agnhost"
build_from_base() {
	printf 'FROM %s\n%s\n' "$base" "$2" >"$ctx/$1.Dockerfile"
	mkdir -p "$ctx/$1"
	cp "$ctx/$1.Dockerfile" "$ctx/$1/Dockerfile"
}
build_from_base glibcdns 'CMD ["sh"]'
build "$ctx/glibcdns" "$glibcdns"
build_from_base iptables 'CMD ["sh"]'
build "$ctx/iptables" "$iptables"
# nginx-light's default site serves /var/www/html on port 80; in the foreground.
build_from_base nginx 'RUN echo "<html><body>nginx</body></html>" >/var/www/html/index.html
EXPOSE 80
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]'
build "$ctx/nginx" "$nginx"

step "busybox, regression-issue-74839, pause"
mkdir -p "$ctx/busybox/rootfs/bin" "$ctx/busybox/rootfs/etc" "$ctx/busybox/rootfs/tmp"
docker run --rm --entrypoint cat "$base" /bin/busybox >"$ctx/busybox/rootfs/bin/busybox"
chmod 0755 "$ctx/busybox/rootfs/bin/busybox"
chmod 1777 "$ctx/busybox/rootfs/tmp"
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n' >"$ctx/busybox/rootfs/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$ctx/busybox/rootfs/etc/group"
cat >"$ctx/busybox/Dockerfile" <<'DF'
FROM scratch
COPY rootfs/ /
RUN ["/bin/busybox", "--install", "-s", "/bin"]
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
CMD ["sh"]
DF
build "$ctx/busybox" "$busybox"
mkdir "$ctx/regression"
cp "$bin/regression-issue-74839" "$ctx/regression/"
printf 'FROM scratch\nCOPY regression-issue-74839 /\nENTRYPOINT ["/regression-issue-74839"]\n' >"$ctx/regression/Dockerfile"
build "$ctx/regression" "$regression"
mkdir "$ctx/pause"
(cd "$root" && CGO_ENABLED=0 "$GO" build -trimpath -ldflags "-s -w" -o "$ctx/pause/pause" ./hack/cluster/pause)
printf 'FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n' >"$ctx/pause/Dockerfile"
build "$ctx/pause" "$pause"

out=${save_only:-$state/e2e-images.tar}
step "saving ${all[*]}"
docker save "${all[@]}" >"$out.tmp"
mv "$out.tmp" "$out"
exec 8>&-
[ -n "$save_only" ] && { step "saved in $out ($(du -h "$out" | cut -f1))"; exit 0; }
import_into_nodes "$out"
step "done ($(du -h "$out" | cut -f1))"
