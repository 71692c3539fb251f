/*
 * cluster-test: the client side of tests/cluster.test (gpxd nodes sharing one etcd).
 *
 *   cluster-test hold SOCK SEED NAME...
 *       registers a buffer of SZ bytes filled from SEED and exports it under each NAME, open
 *       to peers; prints "NAME ok" or "NAME CODE: why" for each, then "ready", and holds the
 *       exports until its stdin ends.
 *   cluster-test get SOCK NAME SEED
 *       imports NAME (bare, or NODE:name), reads it whole into local memory and checks every
 *       byte against SEED; prints "ok" or "CODE: why"; exits 0 only for ok.
 *   cluster-test stream SOCK NAME SECS
 *       imports NAME, then copies from it without pause until a copy fails or SECS pass;
 *       prints "failed after T s: CODE: why" (exit 0), or "never failed" (exit 1).
 *       Its stdin ending starts the clock: the test stops or kills a node, then closes it.
 */
#include "config.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client-lib/gpx.h"
#include "tests/util.h"

#define SZ (1u << 20)

static int
fail(gpx_conn *c, const char *what, int e)
{
	printf("%s%s%s: %s\n", what, what[0] ? " " : "", gpx_strerror(e), c ? gpx_last_error(c) : "");
	fflush(stdout);
	return 1;
}

static int
hold(const char *sock, unsigned seed, int n, char **names)
{
	gpx_conn *c;
	gpx_region r;
	void *p;
	int fd, e;
	char buf[16];

	if ((e = gpx_connect(sock, "cluster-test", &c)) != 0)
		return fail(NULL, "connect", e);
	if ((e = gpx_host_alloc(SZ, &fd, &p)) != 0 || (fill(p, SZ, seed), 0) ||
	    (e = gpx_register_host(c, fd, 0, SZ, 0, &r)) != 0)
		return fail(c, "register", e);
	for (int i = 0; i < n; i++) {
		struct gpx_export_opts o = { .rule = GPX_EXPORT_ANY };
		if ((e = gpx_export_remote(c, r, names[i], &o, NULL)) != 0)
			fail(c, names[i], e);
		else
			printf("%s ok\n", names[i]);
	}
	printf("ready\n");
	fflush(stdout);
	while (read(0, buf, sizeof(buf)) > 0)
		;
	gpx_close(c);
	return 0;
}

/* Copies src whole into dst and waits; 0 or the error. */
static int
copy_wait(gpx_conn *c, gpx_region src, gpx_region dst, uint64_t len, int ms)
{
	struct gpx_completion d;
	int e, n;

	if ((e = gpx_copy(c, src, 0, dst, 0, len, 7)) != 0)
		return e;
	if ((n = gpx_wait(c, &d, 1, ms)) != 1)
		return n < 0 ? n : -GPX_EIO;
	return d.status;
}

/* Says why, lets go of c: 1. */
static int
fail_close(gpx_conn *c, const char *what, int e)
{
	fail(c, what, e);
	gpx_close(c);
	return 1;
}

static int
get(const char *sock, const char *name, unsigned seed)
{
	gpx_conn *c;
	gpx_region rem, loc;
	uint64_t len;
	void *p;
	int fd, e;

	if ((e = gpx_connect(sock, "cluster-test", &c)) != 0)
		return fail(NULL, "connect", e);
	if ((e = gpx_import(c, name, &rem, &len)) != 0)
		return fail_close(c, "", e);
	if (len != SZ) {
		printf("length %llu, not %u\n", (unsigned long long)len, SZ);
		gpx_close(c);
		return 1;
	}
	if ((e = gpx_host_alloc(SZ, &fd, &p)) != 0 || (e = gpx_register_host(c, fd, 0, SZ, 0, &loc)) != 0)
		return fail_close(c, "register", e);
	memset(p, 0, SZ);
	if ((e = copy_wait(c, rem, loc, SZ, 10000)) != 0)
		return fail_close(c, "copy", e);
	char *want = malloc(SZ);
	fill(want, SZ, seed);
	bool same = memcmp(p, want, SZ) == 0;
	free(want);
	gpx_close(c);
	printf("%s\n", same ? "ok" : "bytes differ");
	return same ? 0 : 1;
}

static int
stream(const char *sock, const char *name, double secs)
{
	gpx_conn *c;
	gpx_region rem, loc;
	uint64_t len;
	void *p;
	int fd, e;
	char buf[16];

	if ((e = gpx_connect(sock, "cluster-test", &c)) != 0)
		return fail(NULL, "connect", e);
	if ((e = gpx_import(c, name, &rem, &len)) != 0)
		return fail(c, "import", e);
	if ((e = gpx_host_alloc(SZ, &fd, &p)) != 0 || (e = gpx_register_host(c, fd, 0, SZ, 0, &loc)) != 0)
		return fail(c, "register", e);
	if ((e = copy_wait(c, rem, loc, 4096, 10000)) != 0)
		return fail(c, "first copy", e);
	printf("streaming\n");
	fflush(stdout);
	while (read(0, buf, sizeof(buf)) > 0)
		;
	double t0 = now();
	while (now() - t0 < secs) {
		if ((e = copy_wait(c, rem, loc, 4096, (int)(secs * 1000))) != 0) {
			printf("failed after %.1f s: %s: %s\n", now() - t0, gpx_strerror(e), gpx_last_error(c));
			return 0;
		}
		usleep(20000);
	}
	printf("never failed\n");
	return 1;
}

int
main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc >= 4 && strcmp(argv[1], "hold") == 0)
		return hold(argv[2], (unsigned)atoi(argv[3]), argc - 4, argv + 4);
	if (argc == 5 && strcmp(argv[1], "get") == 0)
		return get(argv[2], argv[3], (unsigned)atoi(argv[4]));
	if (argc == 5 && strcmp(argv[1], "stream") == 0)
		return stream(argv[2], argv[3], atof(argv[4]));
	fprintf(stderr, "usage: cluster-test hold SOCK SEED NAME... | get SOCK NAME SEED | stream SOCK NAME SECS\n");
	return 2;
}
