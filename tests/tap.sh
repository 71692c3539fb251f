# tap.sh: TAP output for the shell tests (sourced, POSIX sh): one "ok N - ..." line per
# check, the plan at the end, and the test's exit status from the checks that failed.

t_n=0
t_fail=0

ok() { t_n=$((t_n + 1)); echo "ok $t_n - $*"; }
not_ok() { t_n=$((t_n + 1)); t_fail=$((t_fail + 1)); echo "not ok $t_n - $*"; }
skip() { t_n=$((t_n + 1)); echo "ok $t_n # SKIP $*"; }
# check DESCRIPTION COMMAND...: one check from a command's exit status.
check() {
	_d=$1
	shift
	if "$@"; then ok "$_d"; else not_ok "$_d"; fi
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
# free_ports N [FROM]: a first port P such that P .. P+N-1 have no listening TCP socket on this
# machine now, from FROM (by default 20000 + this shell's pid mod 20000) upwards.  Tests run
# side by side: ports taken from the pid alone once met another test's listener.
free_ports() {
	_n=$1
	_b=${2:-$((20000 + $$ % 20000))}
	_used=" $(cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | while read -r _sl _local _rem _st _rest; do
		[ "$_st" = 0A ] && printf '%d ' "0x${_local##*:}"
	done)"
	while :; do
		_i=0
		while [ "$_i" -lt "$_n" ]; do
			case "$_used" in *" $((_b + _i)) "*) break ;; esac
			_i=$((_i + 1))
		done
		[ "$_i" = "$_n" ] && break
		_b=$((_b + _i + 1))
		[ $((_b + _n)) -le 60999 ] || _b=20000
	done
	echo "$_b"
}
