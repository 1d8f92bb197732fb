#!/usr/bin/env bash
# images.sh ARCHIVE: the local cluster's images, built without a registry, saved into ARCHIVE
# (a `docker save` tar that hack/cluster/node.sh imports into each node's containerd):
#   kube-userspace-proxy:dev  the top-level Dockerfile, on the locally built base image
#                             (demo/base-image.sh) with binaries built on the host
#                             (hack/prebuilt.sh), as demo/run.sh builds it
#   kup-echo:dev              the Dockerfile's kup-echo stage: static, entrypoint kup-echo
#   kup-pause:dev             the pod sandbox (hack/cluster/pause), named in containerd's config
#   kup-coredns:dev           the cluster's DNS (hack/cluster/coredns, built by coredns.sh or
#                             taken from $KUP_COREDNS), static, FROM scratch
#   kube-proxy:VERSION        upstream kube-proxy ($KUP_K8S_BIN/kube-proxy, make test-bins) on the
#                             same base with nftables added (iptables and conntrack are there)
# Base images with registry access instead: KUP_BASE_IMAGE=debian:bookworm-slim.
set -euo pipefail
out=${1:?usage: images.sh ARCHIVE}
root=$(cd "$(dirname "$0")/../.." && pwd)
GO=${GO:-go}
k8sversion=$(sed -n 's/^KUP_K8S_VERSION *:= *//p' "$root/test/cluster.mk")
etcdversion=$(sed -n 's/^KUP_ETCD_VERSION *:= *//p' "$root/test/cluster.mk")
k8sbin=${KUP_K8S_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/kube-userspace-proxy/bin/k8s-$k8sversion-etcd-$etcdversion}
[ -x "$k8sbin/kube-proxy" ] || { echo "images.sh: $k8sbin/kube-proxy not found: run make test-bins" >&2; exit 1; }
coredns=${KUP_COREDNS:-}
if [ -z "$coredns" ]; then
	coredns=$(GO="$GO" "$root/hack/cluster/coredns.sh" "$("$root/hack/cluster/coredns.sh" --dir)" | tail -n 1)
fi
# The tags are the machine's docker's: one build-and-save at a time (clusters of other names, other
# checkouts), so the archive holds the images this checkout built.
lock=${XDG_CACHE_HOME:-$HOME/.cache}/kube-userspace-proxy/images.lock
mkdir -p "$(dirname "$lock")"
exec 8>"$lock"
flock -n 8 || { echo "images: waiting for another image build on this machine ($lock)"; flock 8; }
base=${KUP_BASE_IMAGE:-}
if [ -z "$base" ]; then
	base=kup-base:bookworm
	"$root/demo/base-image.sh" "$base" >/dev/null
fi
prebuilt=demo/.build/prebuilt
GO="$GO" "$root/hack/prebuilt.sh" "$prebuilt"
args=(--build-arg "BASE_IMAGE=$base" --build-arg "GO_IMAGE=$base" --build-arg "PREBUILT=$prebuilt")
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
# build ARGS...: docker build, its output shown only when it fails.
build() {
	docker build -q "$@" >"$ctx/build.log" 2>&1 || { cat "$ctx/build.log" >&2; return 1; }
}
build "${args[@]}" -t kube-userspace-proxy:dev "$root"
build "${args[@]}" --target kup-echo -t kup-echo:dev "$root"

mkdir "$ctx/pause" "$ctx/coredns" "$ctx/kube-proxy"
(cd "$root" && CGO_ENABLED=0 "$GO" build -trimpath -ldflags "-s -w" -o "$ctx/pause/pause" ./hack/cluster/pause)
printf 'FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n' >"$ctx/pause/Dockerfile"
build -t kup-pause:dev "$ctx/pause"

cp "$coredns" "$ctx/coredns/coredns"
printf 'FROM scratch\nCOPY coredns /coredns\nEXPOSE 53 53/udp\nENTRYPOINT ["/coredns"]\n' >"$ctx/coredns/Dockerfile"
build -t kup-coredns:dev "$ctx/coredns"

# nftables from the base's Debian release, in a layer of its own that docker's cache keeps.
cp "$k8sbin/kube-proxy" "$ctx/kube-proxy/kube-proxy"
cat >"$ctx/kube-proxy/Dockerfile" <<DOCKERFILE
FROM $base
RUN command -v nft >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nftables && rm -rf /var/lib/apt/lists/*; }
COPY kube-proxy /usr/local/bin/kube-proxy
DOCKERFILE
build -t "kube-proxy:$k8sversion" "$ctx/kube-proxy"

images=(kube-userspace-proxy:dev kup-echo:dev kup-pause:dev kup-coredns:dev "kube-proxy:$k8sversion")
docker save "${images[@]}" >"$out.tmp"
mv "$out.tmp" "$out"
echo "images: ${images[*]} ($(du -h "$out" | cut -f1))"
