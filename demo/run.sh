#!/usr/bin/env bash
# Runs the docker-compose demo (make demo): builds what it needs, brings up etcd,
# kube-apiserver, kube-userspace-proxy, two kup-echo backends and the client, prints the
# client's output and exits with the client's status (non-zero if any request failed).
#
#   demo/run.sh            prepare, then run the demo
#   demo/run.sh prepare    only prepare, then print the `docker compose up` command to run
#
# Without a registry (the default here): the base image is built locally (base-image.sh,
# cached) and used for every stage, with the Go binaries built on the host (PREBUILT), and the
# control plane image is built from `make test-bins`'s etcd and kube-apiserver. With public
# images: KUP_BASE_IMAGE=debian:bookworm-slim KUP_GO_IMAGE=golang:1.26-bookworm KUP_PREBUILT=
# KUP_ETCD_IMAGE=registry.k8s.io/etcd:3.6.8-0
# KUP_APISERVER_IMAGE=registry.k8s.io/kube-apiserver:v1.36.3 demo/run.sh builds everything
# inside Docker and pulls the control plane.
set -euo pipefail
cd "$(dirname "$0")"
demo=$PWD
root=$(cd .. && pwd)
compose=(docker-compose -p kup-demo -f "$demo/docker-compose.yaml")
command -v docker-compose >/dev/null || compose=(docker compose -p kup-demo -f "$demo/docker-compose.yaml")
GO=${GO:-go}
KUP_K8S_BIN=${KUP_K8S_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/kube-userspace-proxy/bin/k8s-v1.36.3-etcd-v3.6.8}
# The control plane image built from make test-bins's binaries (unless KUP_ETCD_IMAGE and
# KUP_APISERVER_IMAGE name others).
controlplane=kup-demo/controlplane:latest
t0=$(date +%s)
step() { echo "-- [$(( $(date +%s) - t0 ))s] $*"; }

prepare() {
  if [ -z "${KUP_BASE_IMAGE:-}" ]; then
    step "base image"
    ./base-image.sh kup-base:bookworm
    export KUP_BASE_IMAGE=kup-base:bookworm KUP_GO_IMAGE=kup-base:bookworm KUP_PREBUILT=demo/.build/prebuilt
  fi
  if [ -n "${KUP_PREBUILT:-}" ]; then
    step "Go binaries on the host (CGO_ENABLED=0)"
    GO="$GO" "$root/hack/prebuilt.sh" "$KUP_PREBUILT"
  fi
  if [ -z "${KUP_ETCD_IMAGE:-}" ] || [ -z "${KUP_APISERVER_IMAGE:-}" ]; then
    step "control plane image $controlplane: etcd and kube-apiserver from $KUP_K8S_BIN"
    for b in etcd kube-apiserver; do
      [ -x "$KUP_K8S_BIN/$b" ] || { echo "$KUP_K8S_BIN/$b missing: run make test-bins" >&2; exit 1; }
    done
    mkdir -p controlplane/bin
    for b in etcd kube-apiserver; do
      cmp -s "$KUP_K8S_BIN/$b" "controlplane/bin/$b" || cp "$KUP_K8S_BIN/$b" "controlplane/bin/$b"
    done
    docker build -q -t "$controlplane" --build-arg "BASE_IMAGE=${KUP_BASE_IMAGE:-debian:bookworm-slim}" controlplane >/dev/null
    export KUP_ETCD_IMAGE=${KUP_ETCD_IMAGE:-$controlplane} KUP_APISERVER_IMAGE=${KUP_APISERVER_IMAGE:-$controlplane}
  fi

  local conf=.build/conf
  if [ ! -s "$conf/proxy.kubeconfig" ]; then
    step "keys, tokens and kubeconfigs in demo/$conf"
    mkdir -p "$conf"
    openssl genrsa -out "$conf/sa.key" 2048 2>/dev/null
    openssl rsa -in "$conf/sa.key" -pubout -out "$conf/sa.pub" 2>/dev/null
    local admin proxy
    admin=$(openssl rand -hex 16)
    proxy=$(openssl rand -hex 16)
    # The proxy's token authenticates as the deploy/ ServiceAccount's user name, so the
    # ClusterRoleBinding of deploy/rbac.yaml is all it is allowed.
    cat >"$conf/tokens.csv" <<CSV
$admin,admin,admin,system:masters
$proxy,system:serviceaccount:kube-system:kube-userspace-proxy,kup-proxy,system:serviceaccounts
CSV
    for who in admin proxy; do
      local tok=$admin; [ "$who" = proxy ] && tok=$proxy
      cat >"$conf/$who.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters: [{name: demo, cluster: {server: "https://apiserver:6443", insecure-skip-tls-verify: true}}]
users: [{name: $who, user: {token: "$tok"}}]
contexts: [{name: demo, context: {cluster: demo, user: $who}}]
current-context: demo
KC
    done
    chmod 644 "$conf"/*
  fi

  step "images"
  "${compose[@]}" build -q
}

# up_command prints how to bring the prepared demo up by hand.
up_command() {
  echo "prepared; to run the demo yourself:"
  echo "  cd demo && KUP_ETCD_IMAGE=$KUP_ETCD_IMAGE KUP_APISERVER_IMAGE=$KUP_APISERVER_IMAGE \\"
  echo "    docker compose -p kup-demo up --exit-code-from client; docker compose -p kup-demo down -v"
}

run() {
  step "docker-compose up"
  "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  local rc=0
  "${compose[@]}" up --no-color --exit-code-from client >.build/up.log 2>&1 || rc=$?
  echo
  "${compose[@]}" logs --no-color --no-log-prefix client 2>/dev/null ||
    "${compose[@]}" logs --no-color client | sed 's/^[^|]*| //'
  if [ "$rc" -ne 0 ]; then
    echo "---- demo failed (exit $rc); proxy log:" >&2
    "${compose[@]}" logs --no-color proxy | tail -n 60 >&2 || true
    echo "---- docker-compose up output: demo/.build/up.log" >&2
  fi
  "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  step "done (exit $rc)"
  return "$rc"
}

mkdir -p .build
prepare
if [ "${1:-}" = prepare ]; then
  up_command
  exit 0
fi
run
