#!/bin/sh
# The main job of gpx, shown end to end without root: start a private gpxd on a socket in a
# temporary directory, let clients move memory through it (gpx-example copies 16 MiB and checks
# every byte; gpx-bench keeps it busy for a few seconds), look inside with gpxctl while and after
# they run, and stop the daemon cleanly.
#
# When the Python module was built, a prefill and a decode process also hand KV-cache blocks
# over through it (client-lib/python/examples/kv_handoff.py, host memory).
#
# Usage: tests/demo.sh [BUILDDIR [PYTHON]]     (`make demo` passes both)
# Exit status: 0 when every step worked, 1 otherwise.
set -eu

B=$(cd "${1:-.}" && pwd)
S=$(cd "$(dirname "$0")/.." && pwd)
PY=${2:-python3}
for prog in gpxd gpxctl gpx-example gpx-bench; do
	if [ ! -x "$B/$prog" ]; then
		echo "demo: $B/$prog is missing; build first (make)" >&2
		exit 1
	fi
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpx-demo.XXXXXX")
sock=$tmp/gpxd.sock
gpxd_pid=
bench_pid=

cleanup() {
	if [ -n "$bench_pid" ]; then kill "$bench_pid" 2>/dev/null || :; wait "$bench_pid" 2>/dev/null || :; fi
	if [ -n "$gpxd_pid" ]; then kill "$gpxd_pid" 2>/dev/null || :; wait "$gpxd_pid" 2>/dev/null || :; fi
	rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

if [ -t 1 ]; then bold=$(printf '\033[1m'); plain=$(printf '\033[0m'); else bold=; plain=; fi
step() { printf '\n%s==> %s%s\n' "$bold" "$*" "$plain"; }
show() { printf '%s$ %s%s\n' "$bold" "$*" "$plain"; "$@"; }
die() { echo "demo: $*" >&2; if [ -s "$tmp/gpxd.log" ]; then echo "demo: gpxd's log:" >&2; sed 's/^/  /' "$tmp/gpxd.log" >&2; fi; exit 1; }
ctl() { show "$B/gpxctl" -s "$sock" "$@"; }

step "starting gpxd on $sock"
# A configuration of its own, so that an installed /etc/gpx/gpxd.conf plays no part.
printf '# gpxd of tests/demo.sh\n[daemon]\nworkers = 2\nchunk_size = 2M\n' > "$tmp/gpxd.conf"
# Not a service: no readiness notification or journal hand-over to whoever started make.
env -u NOTIFY_SOCKET -u JOURNAL_STREAM -u LISTEN_FDS -u LISTEN_PID \
	"$B/gpxd" -f -c "$tmp/gpxd.conf" -s "$sock" 2>"$tmp/gpxd.log" &
gpxd_pid=$!
tries=0
until "$B/gpxctl" -s "$sock" status >/dev/null 2>&1; do
	kill -0 "$gpxd_pid" 2>/dev/null || { gpxd_pid=; die "gpxd exited before it was ready"; }
	tries=$((tries + 1))
	[ "$tries" -lt 100 ] || die "gpxd did not answer on $sock within 10 s"
	sleep 0.1
done
ctl status

step "a client registers two buffers and has gpxd copy one into the other (client-lib/example.c)"
show "$B/gpx-example" "$sock" || die "gpx-example failed"

step "gpx-bench moves memory through gpxd for a few seconds; meanwhile:"
"$B/gpx-bench" -s "$sock" --max-size 64M --runs 3 --min-time 100 host >"$tmp/bench.out" 2>&1 &
bench_pid=$!
sleep 2
ctl clients
ctl regions
ctl transfers
ctl stats
st=0
wait "$bench_pid" || st=$?
bench_pid=
step "what gpx-bench measured (in-process memcpy against the same copies brokered by gpxd)"
cat "$tmp/bench.out"
[ "$st" -eq 0 ] || die "gpx-bench failed (status $st)"

if [ "$PY" != ":" ] && [ -f "$B/client-lib/python/gpx/_gpx.abi3.so" ] && "$PY" -c 'import numpy' 2>/dev/null; then
	step "Python: a prefill process exports a paged KV cache, a decode process pulls blocks from it"
	show env PYTHONPATH="$B/client-lib/python" "$PY" "$S/client-lib/python/examples/kv_handoff.py" demo \
		--socket "$sock" --host || die "the Python KV-cache handoff failed"
else
	step "the Python module is not built here (or numpy is missing): no Python demo"
fi

# On a machine with an NVIDIA GPU, the same daemon moves GPU memory: copies between GPUs (or
# within one), host<->GPU, and scattered pages, each next to the direct CUDA figure.
if [ -x "$B/gpx-bench-gpu" ] && [ -e /dev/nvidiactl ] && /sbin/ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then
	step "a GPU is here: gpx-bench-gpu moves GPU memory through the same gpxd"
	ctl topo
	show "$B/gpx-bench-gpu" -s "$sock" --max-size 256M --runs 3 --min-time 100 gpu-copy gpu-host gpu-pages ||
		die "gpx-bench-gpu failed"
else
	step "no NVIDIA GPU here: gpxd serves host memory (gpxctl status says why)"
fi

step "after the clients left"
ctl clients
ctl stats
ctl status

step "stopping gpxd (SIGTERM)"
kill -TERM "$gpxd_pid"
st=0
wait "$gpxd_pid" || st=$?
gpxd_pid=
sed 's/^/  gpxd: /' "$tmp/gpxd.log"
[ "$st" -eq 0 ] || die "gpxd exited with status $st"
[ ! -e "$sock" ] || die "gpxd left its socket behind"
step "done: gpxd started, moved memory for its clients, showed them, and stopped cleanly"
