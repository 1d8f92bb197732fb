#!/bin/sh
# build.sh DIR KUBERNETES_VERSION ETCD_VERSION
#
# Builds kube-apiserver, kube-proxy, kubelet, kube-controller-manager, kube-scheduler, kubectl and
# etcd from this module (see go.mod, written by pin.sh) into DIR, skipping every binary already
# there that reports the pinned version (--version; kubectl: version --client).
# Binaries are built into a temporary directory and moved into place, so an interrupted build
# never leaves a broken binary behind. Called by `make test-bins` (test/cluster.mk).
set -eu
dir=${1:?usage: build.sh DIR KUBERNETES_VERSION ETCD_VERSION}
k8s=${2:?usage: build.sh DIR KUBERNETES_VERSION ETCD_VERSION}
etcd=${3:?usage: build.sh DIR KUBERNETES_VERSION ETCD_VERSION}
GO=${GO:-go}
here=$(cd "$(dirname "$0")" && pwd)
export GOWORK=off

# The pins in go.mod must be the ones asked for.
cd "$here"
have=$($GO list -m -f '{{.Path}} {{.Version}}' k8s.io/kubernetes go.etcd.io/etcd/server/v3)
want="k8s.io/kubernetes $k8s
go.etcd.io/etcd/server/v3 $etcd"
if [ "$have" != "$want" ]; then
	echo "build.sh: test/k8sbin/go.mod pins" >&2
	echo "$have" >&2
	echo "but the build asks for Kubernetes $k8s and etcd $etcd: run test/k8sbin/pin.sh $k8s $etcd" >&2
	exit 1
fi

# version NAME: what DIR/NAME says its version is.
version() {
	if [ "$1" = kubectl ]; then
		"$dir/$1" version --client 2>/dev/null | head -1
	else
		"$dir/$1" --version 2>&1 | head -1
	fi
}

# built NAME VERSION: whether DIR/NAME exists and reports VERSION.
built() {
	[ -x "$dir/$1" ] || return 1
	version "$1" | grep -qF "$2"
}

k8sv=$k8s            # the Kubernetes components print "Kubernetes v1.36.3", kubectl "Client Version: v1.36.3"
etcdv="Version: ${etcd#v}" # etcd prints "etcd Version: 3.6.8"
k8sbins="kube-apiserver kube-proxy kubelet kube-controller-manager kube-scheduler kubectl"
pkgs=
for b in $k8sbins; do
	built "$b" "$k8sv" || pkgs="$pkgs k8s.io/kubernetes/cmd/$b"
done
built etcd "$etcdv" || pkgs="$pkgs go.etcd.io/etcd/server/v3"
if [ -z "$pkgs" ]; then
	echo "test-bins: $k8sbins $k8s and etcd $etcd already built in $dir"
	exit 0
fi

mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
minor=${k8s#v1.}
minor=${minor%%.*}
# The components read their version from component-base, kubectl from client-go: both, as
# Kubernetes' own build stamps them.
ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	ldflags="$ldflags -X $p.gitVersion=$k8s -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
done
echo "test-bins: building$pkgs into $dir (kube-apiserver takes minutes the first time)"
start=$(date +%s)
$GO build -trimpath -buildvcs=false -ldflags="$ldflags" -o "$tmp/" $pkgs
# The etcd server module's main package is at its root: go names the binary after the
# module's last element without the major version ("server").
[ ! -e "$tmp/server" ] || mv "$tmp/server" "$tmp/etcd"
for b in $k8sbins etcd; do
	[ ! -e "$tmp/$b" ] || mv -f "$tmp/$b" "$dir/$b"
done
echo "test-bins: built in $(($(date +%s) - start))s"

for name in $k8sbins etcd; do
	want=$k8sv
	[ "$name" != etcd ] || want=$etcdv
	if ! built "$name" "$want"; then
		echo "build.sh: $dir/$name does not run or does not report $want:" >&2
		version "$name" >&2 || true
		exit 1
	fi
	echo "test-bins: $name: $(version "$name") ($(du -h "$dir/$name" | cut -f1))"
done
