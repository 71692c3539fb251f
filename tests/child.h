/*
 * Children forked by a test to run as another uid: each reports a result through a pipe and
 * ends when the parent closes its cue (tests/child.c).
 */
#ifndef GPX_TESTS_CHILD_H
#define GPX_TESTS_CHILD_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

struct child {
	pid_t pid;
	int rd;             /* the child's result */
	int go;             /* closed by the parent: the child's cue to stop */
};

typedef void (*child_fn)(void *arg, int out, int stop);

/*
 * Forks a child that drops to uid/gid (and the supplementary groups) and runs fn; with nofile,
 * its descriptor limit is set first.  fn writes its result to `out` and may watch `stop`,
 * which becomes readable (EOF) when the parent calls child_stop.
 */
void child_start(struct child *ch, uid_t uid, gid_t gid, const gid_t *groups, int ngroups, int nofile,
    child_fn fn, void *arg);
/* Reads the child's result (size bytes) within timeout_ms, the child going on; true if it came. */
bool child_read(struct child *ch, void *res, size_t size, int timeout_ms);
void child_stop(struct child *ch);
/* Tells the child to stop and reaps it: killed if it has not ended within grace_ms (< 0: waits). */
void child_end(struct child *ch, int grace_ms);
/* Reads the child's result within timeout_ms, then ends it (killed if it did not answer); true if it did. */
bool child_wait(struct child *ch, void *res, size_t size, int timeout_ms);
/* In a child: closes what it inherited but a and b (the pipes of other children included). */
void child_close_others(int a, int b);
/* In a child: whether the parent said stop. */
bool stopped(int stop);

#endif
