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
