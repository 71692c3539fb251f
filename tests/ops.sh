# ops.sh: shell helpers of the deployment tests (sourced, bash).  TAP output (each check an
# "ok N - ..." line, the plan printed at the end), skipping a whole test, a private temporary
# directory removed at exit together with every process the test started, waiting for a
# condition, and installing the build tree into a DESTDIR.
#
# A test that cannot run here prints "1..0 # SKIP why" and exits with $GPX_SKIP_STATUS: 77 by
# hand (the automake convention), 0 under `make check`, where the TAP driver reads the plan.

set -u

: "${GPX_SRCDIR:=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
: "${GPX_BUILDDIR:=$PWD}"
: "${GPXD:=$GPX_BUILDDIR/gpxd}"
: "${GPXCTL:=$GPX_BUILDDIR/gpxctl}"
OPS_CLIENT=$GPX_BUILDDIR/tests/ops-client
NOTIFY_SINK=$GPX_BUILDDIR/tests/notify-sink

. "$GPX_SRCDIR/tests/tap.sh"
t_pids=()
T=

skip_all() {
	echo "1..0 # SKIP $*"
	exit "${GPX_SKIP_STATUS:-77}"
}

# track PID: killed (TERM, then KILL) when the test exits.
track() { t_pids+=("$1"); }

ops_cleanup() {
	local p
	for p in "${t_pids[@]}"; do
		kill -TERM "$p" 2>/dev/null
	done
	for p in "${t_pids[@]}"; do
		for _ in 1 2 3 4 5 6 7 8 9 10; do
			kill -0 "$p" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$p" 2>/dev/null
	done
	[ -n "$T" ] && [ -z "${GPX_KEEP_TMP:-}" ] && rm -rf "$T"
	return 0
}

# ops_tmpdir: a private directory in $T, world-searchable so that a test user can reach it.
ops_tmpdir() {
	T=$(mktemp -d "${TMPDIR:-/tmp}/gpx-ops.XXXXXX") || bail "mktemp failed"
	chmod 0755 "$T"
	trap ops_cleanup EXIT
}

# wait_for SECONDS COMMAND...: polls every 0.1 s until COMMAND succeeds; 1 after SECONDS.
wait_for() {
	local end=$((SECONDS + $1))
	shift
	until "$@" 2>/dev/null; do
		[ "$SECONDS" -ge "$end" ] && return 1
		sleep 0.1
	done
	return 0
}

# need_built FILE...: skip when the build tree lacks a program.
need_built() {
	local f
	for f in "$@"; do
		[ -x "$f" ] || skip_all "$f is not built"
	done
}

# ops_install DESTDIR: `make install DESTDIR=...` of the build tree, serialised between tests.
ops_install() {
	(
		unset MAKEFLAGS MFLAGS MAKELEVEL
		flock 9
		${MAKE:-make} -s -C "$GPX_BUILDDIR" install DESTDIR="$1" >"$1.log" 2>&1
	) 9>"${TMPDIR:-/tmp}/gpx-ops-install.$(id -u).lock"
}

# http_get HOST PORT PATH: the body of an HTTP/1.0 GET (bash's /dev/tcp, no curl needed).
http_get() {
	local host=$1 port=$2 path=$3
	exec 8<>"/dev/tcp/$host/$port" || return 1
	printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$path" "$host" >&8
	# Headers end at the first empty line; print what follows.
	sed '1,/^\r\{0,1\}$/d' <&8
	exec 8<&-
}
