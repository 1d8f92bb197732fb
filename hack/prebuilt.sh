#!/usr/bin/env bash
# prebuilt.sh DIR: the static binaries (CGO_ENABLED=0) the Dockerfile copies when built with
# --build-arg PREBUILT=DIR (DIR relative to the repository root, inside the build context):
# kube-userspace-proxy (stamped as `make build` does), kup-echo and kup-demo. For machines
# without a registry, where the builder stage cannot be a Go image (demo/run.sh,
# hack/cluster/images.sh).
set -euo pipefail
dir=${1:?usage: hack/prebuilt.sh DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
GO=${GO:-go}
cd "$root"
mkdir -p "$dir"
pkg=github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/app
version=$(git describe --tags --always --dirty 2>/dev/null || echo dev)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
export CGO_ENABLED=0
"$GO" build -trimpath -ldflags "-X $pkg.Version=$version -X $pkg.Commit=$commit -X runtime.godebugDefault=memprofilerate=0" \
	-o "$dir/kube-userspace-proxy" ./cmd/kube-userspace-proxy
"$GO" build -trimpath -o "$dir/kup-echo" ./cmd/kup-echo
"$GO" build -trimpath -o "$dir/kup-demo" ./demo/kup-demo
