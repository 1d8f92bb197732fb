# staging.sh: sourced by the pin.sh of test/k8sbin and of test/e2ebin, from their module's
# directory with GOWORK=off and GOFLAGS=-mod=mod set.
#
# k8s.io/kubernetes replaces every staging module (k8s.io/api, k8s.io/client-go, ...) with
# ./staging/..., which a dependent module cannot use: a module that builds from it replaces each
# of them with its published v0.Y.Z instead. The list is read from the release's own go.mod in
# the module cache.

# read_kubernetes_gomod KUBERNETES_VERSION sets gomod (the path of that release's go.mod in the
# module cache, downloaded if need be), mods (the staging modules it replaces) and staging (their
# published version, v0.Y.Z for v1.Y.Z); it exits naming what is missing.
read_kubernetes_gomod() {
	staging=v0${1#v1}
	gomod=$(go mod download -json "k8s.io/kubernetes@$1" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
	[ -n "$gomod" ] || { echo "pin.sh: no go.mod for k8s.io/kubernetes@$1" >&2; exit 1; }
	mods=$(sed -n 's|^[[:space:]]*\([^[:space:]]*\) => \./staging/.*|\1|p' "$gomod")
	[ -n "$mods" ] || { echo "pin.sh: no staging replaces in $gomod" >&2; exit 1; }
}

# staging_replaces prints the go.mod replace block of the staging modules read_kubernetes_gomod
# read.
staging_replaces() {
	echo "replace ("
	for m in $mods; do echo "	$m => $m $staging"; done
	echo ")"
}
