/*
 * What the files of tests/tenants share: the uids the tenants run as, children forked to run
 * as them, sockets connected as them, a raw query, and the parts, by file.
 */
#ifndef GPX_TESTS_TENANTS_H
#define GPX_TESTS_TENANTS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "proto/gpx.pb-c.h"

#define UID_A 1010      /* the heavy or hostile tenant */
#define UID_B 1011      /* the other tenant */
#define UID_ADM 1012    /* a member of the admin group */
#define UID_C 1013      /* a tenant in no group */
#define GID_SHARED 1020 /* B's supplementary group, named by A's gid export */

void msleep(int ms);

/* ---- children running as other uids ---- */

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
void child_stop(struct child *ch);
/* Reads the child's result within timeout_ms (a child that has not answered is killed); true if it did. */
bool child_wait(struct child *ch, void *res, size_t size, int timeout_ms);
/* In a child: whether the parent said stop. */
bool stopped(int stop);
/* A connected socket to path (non-blocking connect when nb); -errno on failure. */
int sock_to(const char *path, bool nb);

/* ---- sockets connected as another uid ---- */

/* A socket connected as uid (a child makes the connection and lives while it is used). */
struct as_conn {
	struct child ch;
	int s;
};

/* Connects a to path as uid/gid (and the groups), says Hello (queries only); 0 or -1. */
int connect_as(struct as_conn *a, const char *path, uid_t uid, gid_t gid, const gid_t *groups, int ngroups);
void as_close(struct as_conn *a);
/* One query on a welcomed connection; the reply (free with gpx__query_reply__free_unpacked) or NULL. */
Gpx__QueryReply *query(int s, Gpx__QueryWhat what);

/* ---- the parts ---- */

/* tests/tenants-flood.c */
void test_flood(void);
void test_hello_max(void);
void test_reserve(void);
/* tests/tenants-view.c */
void test_introspection(void);
/* tests/tenants-fair.c */
void test_fairness(void);

#endif
