#!/bin/bash
# cluster-scale.sh: N gpxd on loopback (default 64) sharing one etcd, each registering NAMES
# cluster names (default 1,000).  Prints: the time from an export to its visibility on every
# other node (p50, p99), the time for every node to see a node's death (kill -9), etcd's
# request rate at rest (lease keep-alives; the watches are streams), and gpxd's memory per
# 1,000 cluster names.  Run from the build directory after make check's programs are built:
#   ../tests/cluster-scale.sh [N [NAMES]] | tee ../tests/results/cluster-scale-64x1000.txt
# Not part of make check: it loads the machine for a minute or two.
set -u
N=${1:-64}
NAMES=${2:-1000}
TTL=${TTL:-10}
SAMPLES=${SAMPLES:-200}
B=${GPX_BUILDDIR:-$PWD}
S=${GPX_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
GPXD=$B/gpxd
CS=$B/tests/cluster-scale
ETCD=$(command -v etcd) || { echo "etcd not installed"; exit 1; }

T=$(mktemp -d "${TMPDIR:-/tmp}/gpx-scale.XXXXXX") || exit 1
cleanup() {
	for f in "$T"/*.pid; do [ -f "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null; done
	rm -rf "$T" "$ED"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

base=$((30000 + $$ % 10000))
PE=$base PE2=$((base + 1))
EURL=http://127.0.0.1:$PE
head -c 32 /dev/urandom | base64 > "$T/key"
chmod 600 "$T/key"

echo "# cluster-scale: $N gpxd x $NAMES names, one etcd, lease_ttl $TTL s"
echo "# $(cd "$S" && git describe --always --dirty 2>/dev/null), $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "# etcd's data in ${ETCD_DATA:-memory (/dev/shm)}"
echo "# $(uname -srm), $(nproc) cores ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)),"\
	"$(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo), $("$ETCD" --version | head -1)"

# etcd's data in memory (ETCD_DATA=DIR for a disk): the figures are gpxd's and etcd's
# processing, not this machine's fsync.
ED=${ETCD_DATA:-$(mktemp -d /dev/shm/gpx-scale-etcd.XXXXXX)}
("$ETCD" --name s --data-dir "$ED/d" --listen-client-urls "$EURL" --advertise-client-urls "$EURL" \
	--listen-peer-urls "http://127.0.0.1:$PE2" --initial-advertise-peer-urls "http://127.0.0.1:$PE2" \
	--initial-cluster "s=http://127.0.0.1:$PE2" > "$T/etcd.log" 2>&1 &
echo $! > "$T/etcd.pid")
for _ in $(seq 100); do curl -s "$EURL/health" | grep -q true && break; sleep 0.1; done

# start I: gpxd number I on ports of its own (tried again elsewhere if another process holds
# one), its metrics port in $T/nI.mport.
start() {
	local i=$1 try p
	for try in 0 1 2 3 4; do
		p=$((base + 2 + try * 3 * N + 2 * i))
		cat > "$T/n$i.conf" <<EOC
[daemon]
socket_mode = 0666
workers = 1
blocking_threads = 1
metrics = 127.0.0.1:$((p + 1))
[cuda]
enable = no
[limits]
exports_per_uid = 1000000
[fabric]
node = n$i
listen = 127.0.0.1:$p
key_file = $T/key
[cluster]
etcd = $EURL
prefix = /scale
lease_ttl = $TTL
EOC
		(env -u NOTIFY_SOCKET "$GPXD" -f -s "$T/n$i.sock" -c "$T/n$i.conf" < /dev/null > /dev/null \
			2>> "$T/n$i.log" & echo $! > "$T/n$i.pid")
		for _ in $(seq 300); do
			kill -0 "$(cat "$T/n$i.pid")" 2>/dev/null || break
			grep -q ' ready ' "$T/n$i.log" && { echo $((p + 1)) > "$T/n$i.mport"; return 0; }
			sleep 0.1
		done
	done
	echo "n$i does not start: $(tail -1 "$T/n$i.log")"
	exit 1
}
for i in $(seq 0 $((N - 1))); do
	start "$i" &
done
wait
for i in $(seq 0 $((N - 1))); do [ -f "$T/n$i.mport" ] || exit 1; done
metric() { curl -s "http://127.0.0.1:$(cat "$T/n$1.mport")/metrics" | awk -v m="$2" '$1 == m { print $2 }'; }
for _ in $(seq 300); do [ "$(metric 0 gpx_cluster_nodes)" = "$N" ] && break; sleep 0.2; done
echo "nodes joined: $(metric 0 gpx_cluster_nodes) seen by n0"
rss() { awk '/VmRSS/ { print $2 }' "/proc/$(cat "$T/n$1.pid")/status"; }
r0=$(rss 1)

t0=$(date +%s.%N)
for i in $(seq 0 $((N - 1))); do
	mkfifo "$T/l$i.in"
	("$CS" load "$T/n$i.sock" "n$i" "$NAMES" < "$T/l$i.in" > "$T/l$i.out" 2>&1 & echo $! > "$T/l$i.pid")
	exec {fd}> "$T/l$i.in"
done
want=$((N * NAMES))
for i in $(seq 0 $((N - 1))); do
	for _ in $(seq 1200); do grep -q loaded "$T/l$i.out" && break; sleep 0.1; done
done
t1=$(date +%s.%N)
for i in $(seq 0 $((N - 1))); do
	for _ in $(seq 600); do [ "$(metric "$i" gpx_cluster_names)" -ge "$want" ] 2>/dev/null && break; sleep 0.2; done
done
t2=$(date +%s.%N)
echo "registration: $want names in $(echo "$t1 - $t0" | bc) s (every export answered);" \
	"known to all $N nodes after $(echo "$t2 - $t0" | bc) s"
echo "per node, the slowest loader: $(sort -k4 -n "$T"/l*.out | tail -1)"
r1=$(rss 1)
echo "gpxd memory (n1's RSS): $r0 KiB with an empty cluster, $r1 KiB knowing $want names:" \
	"$(( (r1 - r0) * 1000 / want )) KiB per 1,000 cluster names"

sum() { s=0; for i in $(seq 0 $((N - 1))); do s=$((s + $(metric "$i" "$1"))); done; echo $s; }
c0=$(sum gpx_cluster_etcd_requests_total)
e0=$(curl -s "$EURL/metrics" | awk '/^grpc_server_started_total/ { s += $2 } END { print s }')
sleep 10
c1=$(sum gpx_cluster_etcd_requests_total)
e1=$(curl -s "$EURL/metrics" | awk '/^grpc_server_started_total/ { s += $2 } END { print s }')
echo "etcd at rest: $(( (c1 - c0) / 10 )) requests/s from the $N gpxd (lease keep-alives, every ttl/3);" \
	"etcd counted $(( (e1 - e0) / 10 )) gRPC calls/s; $N watch streams open"

"$CS" visible "$T" "$N" "$SAMPLES"

victim=$((N / 2))
mkfifo "$T/d.in"
("$CS" death "$T" "$N" "$victim" "n$victim.0" < "$T/d.in" > "$T/d.out" 2>&1 & echo $! > "$T/dp.pid")
exec {dfd}> "$T/d.in"
sleep 1
kill -KILL "$(cat "$T/n$victim.pid")"
echo go >&$dfd
for _ in $(seq 400); do grep -q death "$T/d.out" && break; sleep 0.1; done
cat "$T/d.out"
