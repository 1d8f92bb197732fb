#!/bin/sh
# prometheus.sh DIR: builds the local cluster's Prometheus (the module in hack/cluster/prometheus:
# cmd/prometheus of the release its go.mod pins, with no service discovery but Kubernetes') as
# DIR/prometheus, static. Skips the build when DIR/prometheus reports that release; DIR should
# name the release and the module's content (hack/cluster.sh passes bin/prometheus-VERSION-HASH),
# so a change of the module or of the build tags builds anew. Prints the binary's path last.
#
# The Go module holds the server and its API but not the web UI, which the Prometheus project
# builds with npm into its release archives: this build answers the HTTP API (/api/v1/...),
# /metrics and /-/ready, and its UI paths answer 404.
#
#   prometheus.sh --dir      print the DIR for this checkout's module (under the cache directory)
set -eu
here=$(cd "$(dirname "$0")/prometheus" && pwd)
GO=${GO:-go}
export GOWORK=off
# Kubernetes service discovery only: the others (clouds, Consul, ...) are most of the build.
tags=remove_all_sd,enable_kubernetes_sd
module=$(sed -n 's/^[[:space:]]*\(require \)\{0,1\}github.com\/prometheus\/prometheus \(v[^ ]*\).*$/\2/p' "$here/go.mod")
[ -n "$module" ] || { echo "prometheus.sh: no github.com/prometheus/prometheus version in $here/go.mod" >&2; exit 1; }
# The module's v0.MMmm.p is Prometheus MM.mm.p (v0.316.0 is 3.16.0).
release=$(echo "$module" | awk -F. '{ sub(/^v0$/, "", $1); printf "%d.%d.%s", int($2 / 100), $2 % 100, $3 }')
if [ "${1:-}" = --dir ]; then
	hash=$( (cat "$here/go.mod" "$here/go.sum"; echo "$tags") | sha256sum | cut -c1-12)
	echo "${XDG_CACHE_HOME:-$HOME/.cache}/kube-userspace-proxy/bin/prometheus-$release-$hash"
	exit 0
fi
dir=${1:?usage: prometheus.sh DIR | prometheus.sh --dir}
want="prometheus, version $release"
if [ -x "$dir/prometheus" ] && "$dir/prometheus" --version 2>/dev/null | head -1 | grep -qF "$want "; then
	echo "$dir/prometheus"
	exit 0
fi
mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "prometheus: building Prometheus $release ($module, tags $tags) into $dir" >&2
start=$(date +%s)
(cd "$here" && CGO_ENABLED=0 $GO build -trimpath -buildvcs=false -tags "$tags" \
	-ldflags="-s -w -X github.com/prometheus/common/version.Version=$release -X github.com/prometheus/common/version.Branch=$module" \
	-o "$tmp/prometheus" github.com/prometheus/prometheus/cmd/prometheus)
"$tmp/prometheus" --version 2>/dev/null | head -1 | grep -qF "$want " || {
	echo "prometheus.sh: the build does not report $want:" >&2
	"$tmp/prometheus" --version >&2 || true
	exit 1
}
mv -f "$tmp/prometheus" "$dir/prometheus"
echo "prometheus: built in $(($(date +%s) - start))s ($(du -h "$dir/prometheus" | cut -f1))" >&2
echo "$dir/prometheus"
