#!/bin/sh
# render.sh MIXIN_DIR: renders proxy.json and kube-proxy-alerts.yaml here from a checkout of
# kubernetes-mixin (the tag README.md names) whose vendor/ holds the jsonnet libraries its
# jsonnetfile.lock.json pins (jb install). The jsonnet interpreter is go-jsonnet at the version
# pinned below, run through the Go toolchain. The output is committed: the cluster and the tests
# read these files, not the mixin.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
mixin=$(cd "${1:?usage: render.sh MIXIN_DIR}" && pwd)
GO=${GO:-go}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
(cd "$here" && GOFLAGS=-mod=mod GOWORK=off $GO run github.com/google/go-jsonnet/cmd/jsonnet@v0.22.0 \
	-J "$mixin/vendor" -J "$mixin" -S -m "$out" render.jsonnet >/dev/null)
cp "$out/proxy.json" "$out/kube-proxy-alerts.yaml" "$here/"
echo "rendered $here/proxy.json and $here/kube-proxy-alerts.yaml from $mixin"
