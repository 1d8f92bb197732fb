#!/usr/bin/env bash
# Runs the bundled example: two echo backends on loopback, kube-userspace-proxy serving
# examples/manifests with --portal-mode none (no root, no cluster), and a client that sends
# requests through the proxy port and shows which backend answered each. Only 127.0.0.1 is used
# (macOS has no other loopback address by default), and nothing here is Linux-only.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-bin}
PORT=40000
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

"$BIN/kup-echo" serve --name backend-a --listen 127.0.0.1:18080 & pids+=($!)
"$BIN/kup-echo" serve --name backend-b --listen 127.0.0.1:18081 & pids+=($!)
"$BIN/kube-userspace-proxy" --manifests examples/manifests --portal-mode none \
  --proxy-port-range "$PORT-$PORT" --hostname-override laptop \
  --healthz-bind-address 127.0.0.1:10256 --metrics-bind-address 127.0.0.1:10249 & pids+=($!)

for _ in $(seq 100); do
  "$BIN/kup-echo" request --tcp "127.0.0.1:$PORT" --timeout 1s >/dev/null 2>&1 && break
  sleep 0.1
done
echo "== 6 requests to the proxy listener 127.0.0.1:$PORT (service default/echo:tcp), one connection each:"
answers=$("$BIN/kup-echo" request --tcp "127.0.0.1:$PORT" --count 6)
echo "$answers"
# Round robin over two endpoints: each backend answers every other request, three times.
a=$(grep -c '^backend-a ' <<<"$answers" || true)
b=$(grep -c '^backend-b ' <<<"$answers" || true)
if [ "$a" -ne 3 ] || [ "$b" -ne 3 ] || [ "$(awk '{print $1}' <<<"$answers" | uniq | wc -l)" -ne 6 ]; then
  echo "example FAILED: want backend-a and backend-b alternating, 3 answers each (got a=$a b=$b)" >&2
  exit 1
fi
echo "== ok: the answers alternate between backend-a and backend-b (round robin)"
