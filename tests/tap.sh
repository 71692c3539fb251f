# tap.sh: TAP output for the shell tests (sourced, POSIX sh): one "ok N - ..." line per
# check, the plan at the end, and the test's exit status from the checks that failed.

t_n=0
t_fail=0

ok() { t_n=$((t_n + 1)); echo "ok $t_n - $*"; }
not_ok() { t_n=$((t_n + 1)); t_fail=$((t_fail + 1)); echo "not ok $t_n - $*"; }
skip() { t_n=$((t_n + 1)); echo "ok $t_n # SKIP $*"; }
# check DESCRIPTION COMMAND...: one check from a command's exit status, which it returns too
# (so that `check ... || bail ...` stops a test whose later checks need this one).
check() {
	_d=$1
	shift
	if "$@"; then ok "$_d"; else not_ok "$_d"; return 1; fi
}
# diag [FILE]: a file (or stdin) as TAP comments.
diag() { sed 's/^/# /' "${1:--}"; }
bail() {
	echo "Bail out! $*"
	exit 99
}
# finish: the plan, and the test's exit status.
finish() {
	echo "1..$t_n"
	[ "$t_fail" = 0 ]
	exit $?
}
# free_ports N [FROM]: a first port P such that no TCP socket of this machine has P .. P+N-1
# as its local port now (listening or not), from FROM (by default 20000 + this shell's pid)
# upwards, all below the kernel's ephemeral range (ip_local_port_range), where the local end
# of any connection may take a port between the choice and the bind: an etcd of
# cluster-tls.test once failed to bind 35584 that way.  Tests run side by side: ports taken
# from the pid alone once met another test's listener.
free_ports() {
	_n=$1
	_top=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null)
	_top=${_top:-32768}
	[ "$_top" -gt $((20000 + 2 * _n)) ] || _top=60999    # (a range starting that low: anywhere, as before)
	_b=${2:-$((20000 + $$))}
	_b=$((20000 + (_b - 20000) % (_top - 20000 - _n)))
	_used=" $(cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | while read -r _sl _local _rest; do
		case $_local in *:*) printf '%d ' "0x${_local##*:}" ;; esac
	done)"
	while :; do
		_i=0
		while [ "$_i" -lt "$_n" ]; do
			case "$_used" in *" $((_b + _i)) "*) break ;; esac
			_i=$((_i + 1))
		done
		[ "$_i" = "$_n" ] && break
		_b=$((_b + _i + 1))
		[ $((_b + _n)) -le "$_top" ] || _b=20000
	done
	echo "$_b"
}
