#!/bin/sh
# coredns.sh DIR: builds the local cluster's CoreDNS (the module in hack/cluster/coredns: the
# release its go.mod pins, with only the plugins its main imports) as DIR/coredns, static. Skips
# the build when DIR/coredns reports that release; DIR should name the release and the module's
# content (hack/cluster.sh passes bin/coredns-VERSION-HASH), so a change of plugins builds anew.
# Prints the binary's path last.
#
#   coredns.sh --dir      print the DIR for this checkout's module (under the cache directory)
set -eu
here=$(cd "$(dirname "$0")/coredns" && pwd)
GO=${GO:-go}
export GOWORK=off
version=$(sed -n 's/^require github.com\/coredns\/coredns \(v[^ ]*\)$/\1/p' "$here/go.mod")
[ -n "$version" ] || { echo "coredns.sh: no github.com/coredns/coredns version in $here/go.mod" >&2; exit 1; }
if [ "${1:-}" = --dir ]; then
	hash=$(cat "$here/go.mod" "$here/go.sum" "$here/main.go" | sha256sum | cut -c1-12)
	echo "${XDG_CACHE_HOME:-$HOME/.cache}/kube-userspace-proxy/bin/coredns-$version-$hash"
	exit 0
fi
dir=${1:?usage: coredns.sh DIR | coredns.sh --dir}
want="CoreDNS-${version#v}"
if [ -x "$dir/coredns" ] && "$dir/coredns" -version 2>/dev/null | grep -qxF "$want"; then
	echo "$dir/coredns"
	exit 0
fi
mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "coredns: building CoreDNS $version (the plugins of $here/main.go) into $dir" >&2
start=$(date +%s)
(cd "$here" && CGO_ENABLED=0 $GO build -trimpath -buildvcs=false -ldflags="-s -w" -o "$tmp/coredns" .)
"$tmp/coredns" -version 2>/dev/null | grep -qxF "$want" || {
	echo "coredns.sh: the build does not report $want:" >&2
	"$tmp/coredns" -version >&2 || true
	exit 1
}
mv -f "$tmp/coredns" "$dir/coredns"
echo "coredns: built in $(($(date +%s) - start))s ($(du -h "$dir/coredns" | cut -f1))" >&2
echo "$dir/coredns"
