#!/bin/bash
# vm-systemd-guest.sh: the guest half of tests/vm-systemd.test.  It runs as /share/run.sh in a
# Debian 12 guest with systemd as PID 1 (tests/vm/run), as root, and checks the installed gpx
# the way an operator uses it: the tree from `make install DESTDIR=/share/root` copied in, the
# sysusers and tmpfiles snippets applied, gpxd.socket started, gpxd started by the first
# connection as user gpx, a client moving memory through it, metrics, `systemctl reload`, a
# SIGSTOPped gpxd killed and restarted by the watchdog, a clean `systemctl stop` with a
# transfer in flight, the unit's sandbox admitting what gpxd needs (RDMA devices, loopback
# TCP, pinned memory) while refusing what it does not, and the unit refusing to start a gpxd
# that its sandbox hides (under /var/tmp or /home) with a message that names the cause.  TAP lines go to stdout and to
# /share/tap, which the host renumbers into its own output.
set -u
cd /share || exit 1

TAP=/share/tap
: >"$TAP"
n=0
fail=0
ok() { n=$((n + 1)); echo "ok $n - $*" | tee -a "$TAP"; }
not_ok() { n=$((n + 1)); fail=1; echo "not ok $n - $*" | tee -a "$TAP"; }
check() {
	local d=$1
	shift
	if "$@"; then ok "$d"; else not_ok "$d"; fi
}
diag() { sed 's/^/# /' | tee -a "$TAP"; }
# wait_for SECONDS COMMAND...: wall-clock seconds (an emulated guest may be slow to fork).
wait_for() {
	local end=$((SECONDS + $1))
	shift
	until "$@" 2>/dev/null; do
		[ "$SECONDS" -ge "$end" ] && return 1
		sleep 0.1
	done
}
section() { echo "# ---- $* (t=${SECONDS}s)" | tee -a "$TAP"; }
http_get() {
	exec 8<>"/dev/tcp/$1/$2" || return 1
	printf 'GET %s HTTP/1.0\r\n\r\n' "$3" >&8
	sed '1,/^\r\{0,1\}$/d' <&8
	exec 8<&-
}
prop() { systemctl show -P "$1" gpxd.service; }
journal() { journalctl -q --no-pager -u gpxd.service -o cat; }
as_alice() { setpriv --reuid=alice --regid=alice --init-groups -- "$@"; }
client=/share/bin/ops-client

echo "guest: booted in $(cut -d' ' -f1 /proc/uptime) s; $(systemctl --version | head -n1)"
wait_for 60 bash -c '[ "$(systemctl is-system-running)" = running ]'

# ---- install, as a package would ----
section "install"
tar -C /share/root -cf - . | tar -C / -xf - --keep-directory-symlink
ldconfig
rel() { find /share/root "$@" | head -n1 | sed 's|^/share/root||'; }
svc=$(rel -name gpxd.service)
sock=$(rel -name gpxd.socket)
sysusers=$(rel -path '*/sysusers.d/gpx.conf')
tmpfiles=$(rel -path '*/tmpfiles.d/gpx.conf')
gpxd=$(sed -n 's/^ExecStart=\([^ ]*\).*/\1/p' "$svc")
gpxctl=$(rel -path '*/bin/gpxctl' -type f)
conf=$("$gpxd" -h | sed -n 's/.*(default \(.*gpxd\.conf\)).*/\1/p')
check "installed: units in $(dirname "$svc"), gpxd at $gpxd, gpxctl at $gpxctl" \
	test -f "$svc" -a -f "$sock" -a -x "$gpxd" -a -x "$gpxctl" -a -n "$conf"
# A --prefix whose unit directory systemd does not search (/opt/x/lib/systemd/system, say):
# the units are linked into /etc/systemd/system, as the administrator of such an install does.
unitdir=$(dirname "$svc")
if ! systemd-analyze --system unit-paths 2>/dev/null | grep -qxF "$unitdir"; then
	systemctl link "$svc" "$sock" >/dev/null 2>&1
	check "units linked from $unitdir, which systemd does not search, into /etc/systemd/system" \
		test -L /etc/systemd/system/gpxd.service -a -L /etc/systemd/system/gpxd.socket
fi
systemd-sysusers "$sysusers"
check "sysusers.d: user gpx and group gpx-admin" bash -c 'id gpx && getent group gpx-admin' >/dev/null
systemd-tmpfiles --create "$tmpfiles"
check "tmpfiles.d: /run/gpx is root:root 0755" test "$(stat -c '%U:%G %a' /run/gpx)" = "root:root 755"
systemctl daemon-reload
out=$(systemd-analyze verify --man=no "$sock" "$svc" 2>&1)
check "systemd-analyze verify in the guest" test -z "$out"
[ -z "$out" ] || echo "$out" | diag
mkdir -p "$(dirname "$conf")"
printf '[daemon]\nlog_level = info\nmetrics = 127.0.0.1:9464\n' >"$conf"
useradd -M -s /usr/sbin/nologin -G gpx alice
useradd -M -s /usr/sbin/nologin bob

# ---- socket activation ----
section "socket activation"
systemctl start gpxd.socket
# No RDMA device yet: DeviceAllow=/dev/infiniband/rdma_cm names a node that does not exist,
# and gpxd must start all the same (a node without RDMA).
check "no /dev/infiniband/rdma_cm yet" test ! -e /dev/infiniband/rdma_cm
check "gpxd.socket listening" systemctl -q is-active gpxd.socket
check "/run/gpx/gpxd.sock is srw-rw---- root:gpx" \
	test "$(stat -c '%A %U:%G' /run/gpx/gpxd.sock)" = "srw-rw---- root:gpx"
check "gpxd not started before the first connection" test "$(prop ActiveState)" = inactive
if as_alice "$client" -N vm-alice -n 64 -b 1048576 >c1.out 2>&1; then
	ok "user alice (group gpx): $(cat c1.out)"
else
	not_ok "client of user alice"
	diag <c1.out
fi
check "the first connection started gpxd.service" systemctl -q is-active gpxd.service
pid=$(prop MainPID)
check "gpxd took the socket from systemd" bash -c "journalctl -q -u gpxd -o cat | grep -q '(socket activation)'"
check "gpxd runs as gpx:gpx" test "$(ps -o user=,group= -p "$pid" | tr -s ' ')" = "gpx gpx"
check "no capabilities, no_new_privs, a seccomp filter" \
	bash -c "grep -q '^CapEff:[[:space:]]*0*\$' /proc/$pid/status &&
		grep -q '^CapBnd:[[:space:]]*0*\$' /proc/$pid/status &&
		grep -q '^NoNewPrivs:[[:space:]]*1' /proc/$pid/status &&
		grep -q '^Seccomp:[[:space:]]*2' /proc/$pid/status"
check "memlock limit unlimited (for pinning)" grep -q 'Max locked memory.*unlimited' "/proc/$pid/limits"
check "STATUS= shown by systemctl" bash -c "systemctl show -P StatusText gpxd | grep -q 'clients, .* transfers in flight'"
check "journal entries are structured (priority, identifier)" \
	bash -c "journalctl -q -u gpxd -o verbose | grep -q 'SYSLOG_IDENTIFIER=gpxd' &&
		journalctl -q -u gpxd -o verbose | grep -q 'PRIORITY=6'"
if setpriv --reuid=bob --regid=bob --init-groups -- "$client" -n 1 >c2.out 2>&1; then
	not_ok "user bob, outside group gpx, was let in"
else
	ok "user bob, outside group gpx, cannot connect"
fi
check "gpxctl status (root)" bash -c "'$gpxctl' status | grep -q '^gpxd '"
check "gpxctl clients -j as alice (anyone may query)" \
	bash -c "setpriv --reuid=alice --regid=alice --init-groups -- '$gpxctl' -j clients | grep -q '\"uid\"'"
check "gpxctl reload as alice is refused (not an administrator)" \
	bash -c "! setpriv --reuid=alice --regid=alice --init-groups -- '$gpxctl' reload 2>/dev/null"
http_get 127.0.0.1 9464 /metrics >metrics.txt 2>/dev/null
b=$(sed -n 's/^gpx_path_bytes_total{path="host"} \([0-9]*\)$/\1/p' metrics.txt)
check "metrics on 127.0.0.1:9464 through the sandbox: ${b:-no} bytes on the host path" \
	test "${b:-0}" -ge $((64 << 20))

# ---- the sandbox, replayed around other programs ----
section "sandbox"
GID=$(rxe-setup 2>/dev/null)
# Every [Service] setting of the installed unit except how the process is run, as -p options
# of transient units: what works there works for gpxd, what fails there fails for gpxd.
props=()
while IFS= read -r l; do
	props+=(-p "$l")
done < <(sed -n '/^\[Service\]/,/^\[/p' "$svc" | grep -E '^[A-Z][A-Za-z]*=' |
	grep -Ev '^(Type|ExecStartPre|ExecStart|ExecReload|WatchdogSec|Restart|RestartSec|TimeoutStopSec|StandardError|SyslogIdentifier)=')
sandboxed() { systemd-run --quiet --wait --pipe --collect "${props[@]}" "$@"; }
check "the sandbox replays ($((${#props[@]} / 2)) settings)" bash -c "$(declare -p props); systemd-run --quiet --wait --pipe --collect \"\${props[@]}\" true"
check "sandbox: /etc is read-only" bash -c "$(declare -p props); ! systemd-run --quiet --wait --pipe --collect \"\${props[@]}\" touch /etc/gpx-sandbox 2>/dev/null"
check "sandbox: block devices refused, even to root" \
	bash -c "$(declare -p props); ! systemd-run --quiet --wait --pipe --collect \"\${props[@]}\" -p User=root -p Group=root head -c1 /dev/vda >/dev/null 2>&1"
if [ -n "$GID" ] && [ -e /dev/infiniband/uverbs0 ]; then
	check "sandbox: RDMA device usable (ibv_devinfo rxe0)" \
		bash -c "$(declare -p props); systemd-run --quiet --wait --pipe --collect \"\${props[@]}\" ibv_devinfo -d rxe0 | grep -q PORT_ACTIVE"
	sandboxed timeout 120 ibv_rc_pingpong -d rxe0 -g "$GID" -s 4096 -n 20 >srv.out 2>&1 &
	srv=$!
	cok=1
	for _ in $(seq 30); do
		sleep 0.5
		sandboxed timeout 60 ibv_rc_pingpong -d rxe0 -g "$GID" -s 4096 -n 20 127.0.0.1 >cli.out 2>&1 &&
			{ cok=0; break; }
	done
	wait $srv
	sok=$?
	check "sandbox: verbs ping-pong over rxe0 (registered memory, loopback TCP)" test "$cok$sok" = 00
	[ "$cok$sok" = 00 ] || { diag <cli.out; diag <srv.out; }
else
	ok "sandbox: RDMA devices # SKIP no Soft-RoCE device in this guest"
	ok "sandbox: verbs ping-pong # SKIP no Soft-RoCE device in this guest"
fi

# ---- reload ----
section "reload"
sed -i 's/^log_level = info/log_level = debug/' "$conf"
nr=$(journal | grep -c 'configuration reloaded')
systemctl reload gpxd
wait_for 10 bash -c "[ \$(journalctl -q -u gpxd -o cat | grep -c 'configuration reloaded') -gt $nr ]"
check "systemctl reload: configuration reloaded, same process" \
	bash -c "[ \$(journalctl -q -u gpxd -o cat | grep -c 'configuration reloaded') -gt $nr ] &&
		[ \"\$(systemctl show -P MainPID gpxd)\" = $pid ] && systemctl -q is-active gpxd"
check "the new log level is in effect" bash -c "'$gpxctl' log-level | grep -q '^debug'"

# ---- watchdog: a stopped gpxd is aborted and restarted ----
section "watchdog"
mkdir -p /run/systemd/system/gpxd.service.d
printf '[Service]\nWatchdogSec=3s\n' >/run/systemd/system/gpxd.service.d/watchdog.conf
systemctl daemon-reload
systemctl restart gpxd.service
pid1=$(prop MainPID)
restarts=$(prop NRestarts)
check "gpxd restarted with WatchdogSec=3s" test "$(prop WatchdogUSec)" = 3s
sleep 4
check "a running gpxd keeps the watchdog fed" test "$(prop MainPID)" = "$pid1"
kill -STOP "$pid1"
t0=$(date +%s)
wait_for 40 bash -c "p=\$(systemctl show -P MainPID gpxd); [ \"\$p\" != 0 ] && [ \"\$p\" != $pid1 ] &&
	systemctl -q is-active gpxd"
t1=$(date +%s)
check "the stopped gpxd was killed and restarted ($((t1 - t0)) s)" \
	bash -c "[ \"\$(systemctl show -P MainPID gpxd)\" != $pid1 ] && ! kill -0 $pid1 2>/dev/null"
check "systemd logged a watchdog timeout and counts a restart" \
	bash -c "journalctl -q -u gpxd | grep -qi 'watchdog timeout' && [ \$(systemctl show -P NRestarts gpxd) -gt $restarts ]"
if as_alice "$client" -n 8 >c3.out 2>&1; then ok "clients are served after the restart"; else
	not_ok "client after the watchdog restart"
	diag <c3.out
fi
rm -f /run/systemd/system/gpxd.service.d/watchdog.conf
systemctl daemon-reload
systemctl restart gpxd.service

# ---- a clean stop with a transfer in flight ----
section "stop"
as_alice "$client" -N vm-long -b 4194304 -t 60 -p 2 >c4.out 2>&1 &
cpid=$!
wait_for 10 bash -c "'$gpxctl' clients | grep -q vm-long"
t0=$(date +%s.%N)
systemctl stop gpxd.service
t1=$(date +%s.%N)
secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
check "systemctl stop: done in $secs s, result success, exit status 0" \
	bash -c "[ \"\$(systemctl show -P Result gpxd)\" = success ] &&
		[ \"\$(systemctl show -P ExecMainStatus gpxd)\" = 0 ] &&
		awk -v s=$secs 'BEGIN { exit !(s < 10) }'"
check "gpxd announced the stop and stopped" \
	bash -c "journalctl -q -u gpxd -o cat | grep -q '^stopping:' && journalctl -q -u gpxd -o cat | grep -q '^stopped'"
wait_for 10 bash -c "! kill -0 $cpid"
check "the client in flight was told and did not hang" \
	bash -c "! kill -0 $cpid 2>/dev/null && grep -Eqi 'shutting down|connection was lost|closed' c4.out"
check "the socket stays, and the next connection starts gpxd again" \
	bash -c "setpriv --reuid=alice --regid=alice --init-groups -- '$client' -n 4 >/dev/null &&
		systemctl -q is-active gpxd.service"
systemctl stop gpxd.socket gpxd.service
check "stopping the socket removes it" test ! -e /run/gpx/gpxd.sock
check "no unit failed" bash -c "! systemctl -q is-failed gpxd.service && ! systemctl -q is-failed gpxd.socket"

# ---- a gpxd that the sandbox hides: the service refuses to start and says why ----
section "gpxd where the sandbox cannot see it"
# The installed unit with its paths moved under /var/tmp (PrivateTmp=yes) and /home
# (ProtectHome=yes), as a gpx configured with such a prefix would install it.
for dir in /var/tmp/gpx-hidden /home/gpx-hidden; do
	mkdir -p "$dir/sbin"
	cp "$gpxd" "$dir/sbin/gpxd"
	sed -e "s|$gpxd|$dir/sbin/gpxd|g" -e 's/^Restart=.*/Restart=no/' "$svc" \
		>/run/systemd/system/gpxd-hidden.service
	systemctl daemon-reload
	if systemctl start gpxd-hidden.service 2>/dev/null; then
		not_ok "gpxd under $dir: the service started"
	else
		ok "gpxd under $dir: the service refuses to start"
	fi
	check "gpxd under $dir: its journal names the cause" \
		bash -c "journalctl -q -u gpxd-hidden -o cat | grep -q '$dir/sbin/gpxd cannot be run inside this unit sandbox'"
	journalctl -q -u gpxd-hidden -o cat | grep -F "$dir" | head -n 1 | diag
	systemctl stop gpxd-hidden.service gpxd.socket
	systemctl reset-failed gpxd-hidden.service 2>/dev/null
	rm -f /run/systemd/system/gpxd-hidden.service
	rm -rf "$dir"
done
systemctl daemon-reload

if [ "$fail" != 0 ]; then
	echo "journal of gpxd:" | diag
	journalctl -q --no-pager -u gpxd.service -u gpxd.socket | tail -n 60 | diag
fi
exit $fail
