#!/usr/bin/env bash
# Installs what building and testing kube-userspace-proxy needs on a Debian/Ubuntu machine:
# Debian packages (iptables in both its nft and legacy flavours, iproute2, conntrack, strace, ...;
# containerd, runc, the CNI plugins, socat and curl for the local cluster of `make cluster`, whose kubectl
# is the pinned one that `make test-bins` builds). Idempotent: packages already present are not
# reinstalled.
set -euo pipefail
pkgs=(iptables nftables iproute2 conntrack strace procps kmod ca-certificates haproxy iperf3 debootstrap openssl
  containerd runc containernetworking-plugins socat curl)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
command -v go >/dev/null || { echo "Go is required (https://go.dev/dl); put it on PATH" >&2; exit 1; }
