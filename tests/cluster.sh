# cluster.sh: what tests/cluster.test and tests/cluster-tls.test share (sourced, bash): the
# skips, a private directory T cleaned at exit, gpxd started and stopped by name, clients of
# tests/cluster-test holding exports and importing them.  A node NAME has its configuration
# in $T/NAME.conf (written by the test), its socket $T/NAME.sock, its log $T/NAME.log.
: "${GPX_SRCDIR:=$(cd "$(dirname "$0")/.." && pwd)}"
: "${GPX_BUILDDIR:=$PWD}"
: "${GPXD:=$GPX_BUILDDIR/gpxd}"
: "${GPXCTL:=$GPX_BUILDDIR/gpxctl}"
CT=$GPX_BUILDDIR/tests/cluster-test
ETCD=${ETCD:-$(command -v etcd)}
ETCDCTL=${ETCDCTL:-$(command -v etcdctl)}

. "$GPX_SRCDIR/tests/tap.sh"

if [ -z "$ETCD" ] || [ -z "$ETCDCTL" ]; then
	echo "1..0 # SKIP etcd not installed (Debian: etcd-server etcd-client)"
	exit 0
fi
if ! grep -q 'HAVE_LIBCURL 1' "$GPX_BUILDDIR/config.h" 2>/dev/null; then
	echo "1..0 # SKIP gpxd built without libcurl: no cluster"
	exit 0
fi

T=$(mktemp -d "${TMPDIR:-/tmp}/gpx-cluster.XXXXXX") || exit 99
cleanup() {
	for f in "$T"/*.pid "$T"/*.cpid; do
		[ -f "$f" ] && kill -CONT "$(cat "$f")" 2>/dev/null && kill -KILL "$(cat "$f")" 2>/dev/null
	done
	[ -n "${GPX_KEEP:-}" ] || rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

# start NAME: gpxd on $T/NAME.conf, until it answers on its socket (1 if it exits first).
start() {
	(for v in ${!fd_@}; do eval "exec {$v}>&-"; done
	env -u NOTIFY_SOCKET -u LISTEN_FDS -u LISTEN_PID -u WATCHDOG_USEC \
		"$GPXD" -f -s "$T/$1.sock" -c "$T/$1.conf" < /dev/null > /dev/null 2>> "$T/$1.log" &
	echo $! > "$T/$1.pid")
	for _ in $(seq 150); do
		"$GPXCTL" -s "$T/$1.sock" status > /dev/null 2>&1 && return 0
		kill -0 "$(cat "$T/$1.pid")" 2>/dev/null || return 1
		sleep 0.1
	done
	return 1
}
stop() { kill -TERM "$(cat "$T/$1.pid")" 2>/dev/null; wait_gone "$(cat "$T/$1.pid")"; rm -f "$T/$1.pid"; }
wait_gone() { for _ in $(seq 100); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done; return 1; }
# wait_for SECS COMMAND...: COMMAND succeeds within SECS (tried every 0.1 s, SECS x 10 times),
# and the wait ends by 3 x SECS however long each try takes: against an etcd that is not
# there each etcdctl call waits 5 s, and a wait of 10 s took 500.
wait_for() {
	s=$1
	shift
	_end=$((SECONDS + 3 * s))
	for _ in $(seq $((s * 10))); do
		"$@" && return 0
		[ "$SECONDS" -lt "$_end" ] || return 1
		sleep 0.1
	done
	return 1
}
# hold TAG NODE SEED NAME...: a client of NODE holding exports, until release TAG; it
# returns once the exports are answered ("ready" in $T/TAG.out).  hold_start: the same,
# returning at once.
hold() {
	hold_start "$@" && wait_for 10 grep -q '^ready' "$T/$1.out"
}
hold_start() {
	tag=$1 node=$2 seed=$3
	shift 3
	mkfifo "$T/$tag.in"
	# (the other holders' fifos closed in it: each holder's stdin ends only with its release)
	(for v in ${!fd_@}; do eval "exec {$v}>&-"; done
	"$CT" hold "$T/$node.sock" "$seed" "$@" < "$T/$tag.in" > "$T/$tag.out" 2>&1 &
	echo $! > "$T/$tag.cpid")
	exec {fd}> "$T/$tag.in"
	eval "fd_$tag=$fd"
}
# stream TAG NODE NAME: a client of NODE copying from NAME once stream_go TAG is said.
stream() {
	mkfifo "$T/$1.in"
	(for v in ${!fd_@}; do eval "exec {$v}>&-"; done
	"$CT" stream "$T/$2.sock" "$3" 20 < "$T/$1.in" > "$T/$1.out" 2>&1 &
	echo $! > "$T/$1.cpid")
	exec {fd}> "$T/$1.in"
	eval "fd_$1=$fd"
	wait_for 10 grep -q '^streaming' "$T/$1.out"
}
stream_go() { eval "exec {fd_$1}>&-"; }
# failed_within TAG SECS WORDS: the stream ended with an error saying WORDS, in SECS or less.
failed_within() {
	wait_gone "$(cat "$T/$1.cpid")" || sleep 15
	diag "$T/$1.out"
	awk -v s="$2" '/^failed after/ { exit !($3 <= s) } END { if (NR == 0) exit 1 }' "$T/$1.out" &&
		grep -q -- "$3" "$T/$1.out"
}
release() { eval "exec {fd_$1}>&-"; wait_gone "$(cat "$T/$1.cpid")"; }
# get NODE NAME SEED: a client of NODE imports NAME and checks every byte against SEED.
get() {
	"$CT" get "$T/$1.sock" "$2" "$3" > "$T/get.out" 2>&1 && return 0
	diag "$T/get.out"
	return 1
}
get_says() { get "$1" "$2" "$3"; grep -q -- "$4" "$T/get.out"; }
