/*
 * Children forked by a test to run as another uid (tests/child.h).
 */
#include "config.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include "tests/child.h"
#include "tests/tap.h"

#define FD_SWEEP 4096     /* a child closes what it inherited below this */

void
child_close_others(int a, int b)
{
	for (int fd = 3; fd < FD_SWEEP; fd++)
		if (fd != a && fd != b)
			close(fd);
}

void
child_start(struct child *ch, uid_t uid, gid_t gid, const gid_t *groups, int ngroups, int nofile,
    child_fn fn, void *arg)
{
	int res[2], go[2];

	if (pipe2(res, O_CLOEXEC) < 0 || pipe2(go, O_CLOEXEC) < 0)
		tap_bail("pipe");
	fflush(NULL);
	if ((ch->pid = fork()) < 0)
		tap_bail("fork");
	if (ch->pid == 0) {
		/* Nothing of the parent's: the other children's pipes would keep them from their end. */
		child_close_others(res[1], go[0]);
		if (nofile > 0) {
			struct rlimit rl = { (rlim_t)nofile, (rlim_t)nofile };
			setrlimit(RLIMIT_NOFILE, &rl);
		}
		if (setgroups(ngroups, groups) < 0 || setgid(gid) < 0 || setuid(uid) < 0)
			_exit(98);
		fn(arg, res[1], go[0]);
		_exit(0);
	}
	close(res[1]);
	close(go[0]);
	ch->rd = res[0];
	ch->go = go[1];
}

bool
child_read(struct child *ch, void *res, size_t size, int timeout_ms)
{
	struct pollfd p = { .fd = ch->rd, .events = POLLIN };
	size_t got = 0;

	while (got < size && poll(&p, 1, timeout_ms) == 1) {
		ssize_t n = read(ch->rd, (char *)res + got, size - got);
		if (n <= 0)
			break;
		got += n;
	}
	return got == size;
}

void
child_stop(struct child *ch)
{
	if (ch->go >= 0)
		close(ch->go);
	ch->go = -1;
}

void
child_end(struct child *ch, int grace_ms)
{
	child_stop(ch);
	for (int waited = 0; grace_ms < 0 || waited < grace_ms; waited += 10) {
		pid_t r = waitpid(ch->pid, NULL, grace_ms < 0 ? 0 : WNOHANG);
		if (r == ch->pid || r < 0)
			goto reaped;
		usleep(10000);
	}
	kill(ch->pid, SIGKILL);
	waitpid(ch->pid, NULL, 0);
reaped:
	close(ch->rd);
}

bool
child_wait(struct child *ch, void *res, size_t size, int timeout_ms)
{
	bool got = child_read(ch, res, size, timeout_ms);

	child_end(ch, got ? -1 : 0);
	return got;
}

bool
stopped(int stop)
{
	struct pollfd p = { .fd = stop, .events = POLLIN };

	return poll(&p, 1, 0) == 1;
}
