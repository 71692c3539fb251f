# harness.sh: the shell side of the test harness (sourced by tests/*.test, POSIX sh).  TAP output
# (one "ok N - ..." line per check, the plan at the end), and a real gpxd on a private socket
# in a fresh temporary directory, with the same test configuration as tests/harness.c, stopped
# with SIGTERM and removed with everything else when the test exits.
#
# After h_start: H_DIR, H_SOCK, H_CONF, H_LOG and H_PID describe the daemon.

set -u

: "${GPX_SRCDIR:=$(cd "$(dirname "$0")/.." && pwd)}"
: "${GPX_BUILDDIR:=$PWD}"
: "${GPXD:=$GPX_BUILDDIR/gpxd}"
: "${GPXCTL:=$GPX_BUILDDIR/gpxctl}"

. "$GPX_SRCDIR/tests/tap.sh"
H_DIR=
H_PID=

h_cleanup() {
	if [ -n "$H_PID" ]; then
		kill -KILL "$H_PID" 2>/dev/null
		wait "$H_PID" 2>/dev/null
		H_PID=
	fi
	[ -n "$H_DIR" ] && rm -rf "$H_DIR"
}
trap h_cleanup EXIT
trap 'exit 1' INT TERM HUP

# h_start [EXTRA]: writes the configuration (plus EXTRA, ini text), starts gpxd and waits until
# it answers gpxctl.  Returns non-zero (with the log as comments) if it does not come up.
h_start() {
	H_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpx-test.XXXXXX") || return 1
	chmod 755 "$H_DIR"
	H_SOCK=$H_DIR/gpxd.sock
	H_CONF=$H_DIR/gpxd.conf
	H_LOG=$H_DIR/gpxd.log
	{
		printf '# written by the gpx test harness\n[daemon]\nsocket_mode = 0666\nworkers = 2\n'
		printf 'blocking_threads = 2\nring_entries = 64\nchunk_size = 64K\nmax_segments = 131072\n'
		printf 'log_level = info\n'
		# The user running the test administers its own daemon.
		printf 'admin_group = %s\n' "$(id -gn)"
		[ $# -gt 0 ] && printf '%s\n' "$1"
	} > "$H_CONF"
	env -u NOTIFY_SOCKET -u JOURNAL_STREAM -u LISTEN_FDS -u LISTEN_PID -u WATCHDOG_USEC \
		"$GPXD" -f -s "$H_SOCK" -c "$H_CONF" < /dev/null > /dev/null 2> "$H_LOG" &
	H_PID=$!
	_i=0
	while [ $_i -lt 300 ]; do
		"$GPXCTL" -s "$H_SOCK" status > /dev/null 2>&1 && return 0
		kill -0 "$H_PID" 2>/dev/null || break
		sleep 0.1
		_i=$((_i + 1))
	done
	echo "# gpxd did not come up on $H_SOCK"
	diag "$H_LOG"
	return 1
}

# h_stop: SIGTERM and reap; returns gpxd's exit status.
h_stop() {
	[ -n "$H_PID" ] || return 1
	kill -TERM "$H_PID"
	wait "$H_PID"
	_st=$?
	H_PID=
	return $_st
}

# h_fds: the number of descriptors gpxd holds open.
h_fds() { ls "/proc/$H_PID/fd" | wc -l; }
