#!/bin/sh
# build.sh DIR KUBERNETES_VERSION
#
# Builds Kubernetes' end-to-end suite and what runs it from this module (see go.mod, written by
# pin.sh) into DIR, skipping every binary already there that reports the pinned version:
#   e2e.test  k8s.io/kubernetes/test/e2e as a test binary (go test -c -vet=off: vet would walk
#             ~2,800 packages); ~25 min cold on 2 busy cores, ~2 min to relink
#   ginkgo    the ginkgo CLI at the version Kubernetes requires, which runs e2e.test's specs in
#             parallel processes (-p/--procs)
#   agnhost   k8s.io/kubernetes/test/images/agnhost, the suite's test server, for its image
#             (hack/conformance/images.sh)
#   regression-issue-74839  the suite's image of that name
# Binaries are built into a temporary directory and moved into place, so an interrupted build
# never leaves a broken binary behind. Called by `make e2e-bins` (test/conformance.mk).
set -eu
dir=${1:?usage: build.sh DIR KUBERNETES_VERSION}
k8s=${2:?usage: build.sh DIR KUBERNETES_VERSION}
GO=${GO:-go}
here=$(cd "$(dirname "$0")" && pwd)
export GOWORK=off

cd "$here"
have=$($GO list -m -f '{{.Version}}' k8s.io/kubernetes)
if [ "$have" != "$k8s" ]; then
	echo "build.sh: test/e2ebin/go.mod pins k8s.io/kubernetes $have, the build asks for $k8s: run test/e2ebin/pin.sh $k8s" >&2
	exit 1
fi
ginkgov=$($GO list -m -f '{{.Version}}' github.com/onsi/ginkgo/v2)
agnhostv=$(cat "$($GO list -m -f '{{.Dir}}' k8s.io/kubernetes)/test/images/agnhost/VERSION")

# built NAME VERSION ARGS...: whether DIR/NAME exists and, run with ARGS, prints VERSION.
built() {
	name=$1 want=$2
	shift 2
	[ -x "$dir/$name" ] || return 1
	"$dir/$name" "$@" 2>/dev/null | grep -qF "$want"
}

minor=${k8s#v1.}
minor=${minor%%.*}
k8sflags="-X k8s.io/component-base/version.gitVersion=$k8s -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.build-e2e.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# step NAME: prints how long building NAME took.
step() {
	echo "e2e-bins: $1 built in $(($(date +%s) - start))s ($(du -h "$dir/$1" | cut -f1))"
}

if ! built ginkgo "Version ${ginkgov#v}" version; then
	echo "e2e-bins: building ginkgo $ginkgov"
	start=$(date +%s)
	$GO build -trimpath -buildvcs=false -ldflags="-s -w" -o "$tmp/ginkgo" github.com/onsi/ginkgo/v2/ginkgo
	mv -f "$tmp/ginkgo" "$dir/ginkgo"
	step ginkgo
fi
# agnhost runs in images on the same Debian as this machine: dynamically linked like the rest.
if ! built agnhost "$agnhostv" --version; then
	echo "e2e-bins: building agnhost $agnhostv"
	start=$(date +%s)
	$GO build -trimpath -buildvcs=false -ldflags="-s -w -X main.Version=$agnhostv" -o "$tmp/agnhost" k8s.io/kubernetes/test/images/agnhost
	mv -f "$tmp/agnhost" "$dir/agnhost"
	step agnhost
fi
if [ ! -x "$dir/regression-issue-74839" ]; then
	start=$(date +%s)
	CGO_ENABLED=0 $GO build -trimpath -buildvcs=false -ldflags="-s -w" -o "$tmp/regression-issue-74839" k8s.io/kubernetes/test/images/regression-issue-74839
	mv -f "$tmp/regression-issue-74839" "$dir/regression-issue-74839"
	step regression-issue-74839
fi
if ! built e2e.test "$k8s" --version; then
	echo "e2e-bins: building e2e.test $k8s (about 25 minutes the first time on 2 cores)"
	start=$(date +%s)
	$GO test -c -vet=off -trimpath -buildvcs=false -ldflags="-s -w $k8sflags" -o "$tmp/e2e.test" k8s.io/kubernetes/test/e2e
	mv -f "$tmp/e2e.test" "$dir/e2e.test"
	step e2e.test
fi
check() {
	built "$@" && return 0
	echo "build.sh: $dir/$1 does not run or does not report $2" >&2
	exit 1
}
check e2e.test "$k8s" --version
check ginkgo "Version ${ginkgov#v}" version
check agnhost "$agnhostv" --version
echo "e2e-bins: e2e.test $k8s, ginkgo $ginkgov, agnhost $agnhostv and regression-issue-74839 in $dir"
