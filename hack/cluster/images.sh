#!/usr/bin/env bash
# images.sh ARCHIVE: the local cluster's images, built without a registry, saved into ARCHIVE
# (a `docker save` tar that hack/cluster/node.sh imports into each node's containerd):
#   kube-userspace-proxy:dev  the top-level Dockerfile, on the locally built base image
#                             (demo/base-image.sh) with binaries built on the host
#                             (hack/prebuilt.sh), as demo/run.sh builds it
#   kup-echo:dev              the Dockerfile's kup-echo stage: static, entrypoint kup-echo
#   kup-pause:dev             the pod sandbox (hack/cluster/pause), named in containerd's config
# Base images with registry access instead: KUP_BASE_IMAGE=debian:bookworm-slim.
set -euo pipefail
out=${1:?usage: images.sh ARCHIVE}
root=$(cd "$(dirname "$0")/../.." && pwd)
GO=${GO:-go}
# The tags are the machine's docker's: one build-and-save at a time (clusters of other names, other
# checkouts), so the archive holds the images this checkout built.
lock=${XDG_CACHE_HOME:-$HOME/.cache}/kube-userspace-proxy/images.lock
mkdir -p "$(dirname "$lock")"
exec 8>"$lock"
flock 8
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

(cd "$root" && CGO_ENABLED=0 "$GO" build -trimpath -ldflags "-s -w" -o "$ctx/pause" ./hack/cluster/pause)
printf 'FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n' >"$ctx/Dockerfile"
build -t kup-pause:dev "$ctx"
docker save kube-userspace-proxy:dev kup-echo:dev kup-pause:dev >"$out.tmp"
mv "$out.tmp" "$out"
echo "images: kube-userspace-proxy:dev kup-echo:dev kup-pause:dev ($(du -h "$out" | cut -f1))"
