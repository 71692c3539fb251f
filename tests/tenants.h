/*
 * What the files of tests/tenants share: the uids the tenants run as, sockets connected as
 * them (children run as them: tests/child.h), a raw query, and the parts, by file.
 */
#ifndef GPX_TESTS_TENANTS_H
#define GPX_TESTS_TENANTS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "proto/gpx.pb-c.h"
#include "tests/child.h"

#define UID_A 1010      /* the heavy or hostile tenant */
#define UID_B 1011      /* the other tenant */
#define UID_ADM 1012    /* a member of the admin group */
#define UID_C 1013      /* a tenant in no group */
#define GID_SHARED 1020 /* B's supplementary group, named by A's gid export */

void msleep(int ms);

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
