#!/usr/bin/env bash
# Builds the demo's base image locally, for machines whose Docker engine cannot pull images:
# a minimal Debian bookworm (debootstrap --variant=minbase) with iptables, iproute2 and conntrack, imported as
# kup-base:bookworm. Skips everything when the image already exists (delete it to rebuild).
#
#   demo/base-image.sh [IMAGE]      default IMAGE: kup-base:bookworm
#
# KUP_BASE_EXTRA=pkg,pkg,... adds Debian packages to the image (hack/conformance/images.sh builds
# the upstream end-to-end suite's images on such a base).
#
# The mirror is the one apt uses on this machine (from /etc/apt/sources.list*), else debootstrap's
# own default. Needs root and debootstrap (installed with apt-get when missing).
set -euo pipefail
image=${1:-kup-base:bookworm}
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "base image $image exists; not rebuilding"
  exit 0
fi

mirror=$(grep -hoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null \
  | grep -oE 'https?://[^ ]+' | head -n1 || true)

if ! command -v debootstrap >/dev/null; then
  echo "installing debootstrap"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi

dir=$(mktemp -d /tmp/kup-base.XXXXXX)
trap 'rm -rf "$dir"' EXIT
echo "debootstrap bookworm from ${mirror:-the default mirror of debootstrap} into $dir (a few minutes cold)"
start=$(date +%s)
debootstrap --variant=minbase --include=iptables,iproute2,conntrack,ca-certificates${KUP_BASE_EXTRA:+,$KUP_BASE_EXTRA} bookworm "$dir" ${mirror:+"$mirror"} >"$dir.log" 2>&1 || {
  tail -n 30 "$dir.log" >&2; rm -f "$dir.log"; exit 1; }
rm -f "$dir.log"
# Keep the image small: no apt lists, no docs, no caches.
rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb \
  "$dir"/usr/share/doc/* "$dir"/usr/share/man/* "$dir"/usr/share/locale/*
tar -C "$dir" -c . | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$image" >/dev/null
echo "base image $image built in $(( $(date +%s) - start ))s"
