#!/usr/bin/env bash
# bench/cluster-day.sh [PROXY...]: a node's day on the local cluster, side by side for service
# proxies. For each PROXY (default: kube-userspace-proxy kube-proxy-iptables kube-proxy-nftables)
# it switches the cluster's service proxy (hack/cluster.sh proxy PROXY) and runs test/kcluster's
# TestDay* scenarios (scale 10 → 1 twice, pod deletions, a drain, a node restart, an API-server
# restart, a SIGKILL of the service proxy on node-1), each under 50 new connections a second from a client outside the cluster through a
# NodePort, with a 0.5 s client timeout; failed connections are counted, not fatal
# (KUP_DAY_MEASURE). Then it writes the table of failed connections per scenario and proxy.
#
#   export KUP_CLUSTER_NAME=... KUP_CLUSTER_PORT=...   # as for make cluster
#   make cluster && bench/cluster-day.sh
#
# Output (KUP_DAY_OUT, default bench/results): cluster-day.tsv (a line per scenario run: proxy,
# scenario, connections, failed, failures by kind, each failure's time and kind) and
# cluster-day-table.md (the table). A scenario that cannot run for a proxy fails its test and
# the script goes on with the next proxy.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${KUP_DAY_OUT:-$root/bench/results}
proxies=("$@")
[ ${#proxies[@]} -gt 0 ] || proxies=(kube-userspace-proxy kube-proxy-iptables kube-proxy-nftables)
mkdir -p "$out"
tsv=$out/cluster-day.tsv
: >"$tsv"
rc=0
for p in "${proxies[@]}"; do
	echo "== $p"
	if [ "$p" = kube-userspace-proxy ] && ! "$root/hack/cluster.sh" proxy >/dev/null 2>&1; then
		"$root/hack/cluster.sh" deploy # a cluster.sh without proxy switching: ours only
	else
		"$root/hack/cluster.sh" proxy "$p"
	fi
	(cd "$root" && KUP_DAY_PROXY=$p KUP_DAY_REPORT=$tsv KUP_DAY_MEASURE=1 \
		${GO:-go} test -count=1 -tags cluster -run '^TestDay' -v -timeout 20m ./test/kcluster/) ||
		{ echo "cluster-day: scenarios failed for $p" >&2; rc=1; }
done
# The table: failed / connections per scenario (summed over its runs) and proxy.
awk -F'\t' -v proxies="${proxies[*]}" '
	!($2 in seen) { seen[$2] = 1; order[++n] = $2 }
	{ conns[$1, $2] += $3; failed[$1, $2] += $4; if ($4 > 0) kinds[$1, $2] = kinds[$1, $2] (kinds[$1, $2] == "" ? "" : "; ") $5 }
	END {
		np = split(proxies, ps, " ")
		printf "| scenario |"; for (i = 1; i <= np; i++) printf " %s |", ps[i]; print ""
		printf "|---|"; for (i = 1; i <= np; i++) printf "---|"; print ""
		for (k = 1; k <= n; k++) {
			printf "| %s |", order[k]
			for (i = 1; i <= np; i++) {
				key = ps[i] SUBSEP order[k]
				if (!(key in conns)) { printf " – |"; continue }
				printf " %d of %d%s |", failed[key], conns[key], (kinds[key] != "" ? " (" kinds[key] ")" : "")
			}
			print ""
		}
	}' "$tsv" >"$out/cluster-day-table.md"
cat "$out/cluster-day-table.md"
exit $rc
