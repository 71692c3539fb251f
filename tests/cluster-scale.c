/*
 * cluster-scale: the client side of tests/cluster-scale.sh, a simulation of many gpxd on
 * this machine sharing one etcd.  Not part of make check: it loads the machine for a minute.
 *
 *   cluster-scale load SOCK PREFIX COUNT
 *       exports COUNT names PREFIX.0 .. PREFIX.(COUNT-1) open to peers (one host region),
 *       prints "loaded COUNT in T s", then holds them until its stdin ends.
 *   cluster-scale visible SOCKDIR N SAMPLES
 *       gpxd number i listens on SOCKDIR/nI.sock.  SAMPLES times: one node (in turn) exports
 *       a fresh name, and the others are asked to import it until each stops answering
 *       "no such export"; prints the time from the export's answer until every node sees it
 *       (p50, p99, max) and until one node sees it (p50, p99).  A node that sees the name
 *       imports it at once, so a time includes one import across the fabric.
 *   cluster-scale death SOCKDIR N VICTIM NAME
 *       after a line on stdin (the victim was just killed or stopped), asks every node but
 *       VICTIM to import NAME, one of the victim's, until each says there is no such export;
 *       prints the time until the last one does.
 */
#include "config.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client-lib/gpx.h"
#include "tests/util.h"

static double
pct(double *v, int n, double p)
{
	int i = (int)(p * (n - 1) + 0.5);

	return v[i < n ? i : n - 1];
}

static int
load(const char *sock, const char *prefix, int count)
{
	gpx_conn *c;
	gpx_region r;
	void *p;
	int fd, e;
	char name[80], buf[16];

	if ((e = gpx_connect(sock, "scale-load", &c)) != 0 || (e = gpx_host_alloc(4096, &fd, &p)) != 0 ||
	    (e = gpx_register_host(c, fd, 0, 4096, 0, &r)) != 0) {
		fprintf(stderr, "%s: %s\n", sock, gpx_strerror(e));
		return 1;
	}
	double t0 = now();
	int again = 0;
	for (int i = 0; i < count; i++) {
		struct gpx_export_opts o = { .rule = GPX_EXPORT_ANY };
		snprintf(name, sizeof(name), "%s.%d", prefix, i);
		/* etcd too slow for a moment (the node rejoins): the export is tried again */
		while ((e = gpx_export_remote(c, r, name, &o, NULL)) == -GPX_EIO && again < 1000) {
			again++;
			usleep(200000);
		}
		if (e != 0) {
			fprintf(stderr, "%s: export %s: %s: %s\n", sock, name, gpx_strerror(e), gpx_last_error(c));
			return 1;
		}
	}
	printf("loaded %d in %.3f s (%d tried again)\n", count, now() - t0, again);
	fflush(stdout);
	while (read(0, buf, sizeof(buf)) > 0)
		;
	return 0;
}

static gpx_conn **
connect_all(const char *dir, int n)
{
	gpx_conn **c = calloc(n, sizeof(*c));
	char sock[512];

	for (int i = 0; i < n; i++) {
		snprintf(sock, sizeof(sock), "%s/n%d.sock", dir, i);
		if (gpx_connect(sock, "scale-probe", &c[i]) != 0) {
			fprintf(stderr, "cannot connect to %s\n", sock);
			exit(1);
		}
	}
	return c;
}

/* Polls the nodes (all but skip) until each import of name answers (seen: not ENOENT, or
 * gone: ENOENT); the time of the last, and of the first in *first.  -1 after 30 s. */
static double
poll_all(gpx_conn **c, int n, int skip, const char *name, bool want_gone, double t0, double *first)
{
	bool *done = calloc(n, sizeof(*done));
	int left = n - 1;
	double last = -1;

	*first = -1;
	while (left > 0 && now() - t0 < 30) {
		for (int j = 0; j < n; j++) {
			gpx_region r;
			uint64_t len;
			if (j == skip || done[j])
				continue;
			int e = gpx_import(c[j], name, &r, &len);
			if (e == 0)
				gpx_deregister(c[j], r);
			if ((e == -GPX_ENOENT) == want_gone) {
				done[j] = true;
				left--;
				last = now() - t0;
				if (*first < 0)
					*first = last;
			}
		}
	}
	free(done);
	return left == 0 ? last : -1;
}

static int
visible(const char *dir, int n, int samples)
{
	gpx_conn **c = connect_all(dir, n);
	double *all = calloc(samples, sizeof(double)), *one = calloc(samples, sizeof(double));
	gpx_region *reg = calloc(n, sizeof(*reg));
	char name[64];
	void *p;
	int fd, k = 0;

	for (int i = 0; i < n; i++)
		if (gpx_host_alloc(4096, &fd, &p) != 0 || gpx_register_host(c[i], fd, 0, 4096, 0, &reg[i]) != 0)
			return 1;
	for (int s = 0; s < samples; s++) {
		int h = s % n;
		struct gpx_export_opts o = { .rule = GPX_EXPORT_ANY };
		snprintf(name, sizeof(name), "probe.%d.%d", getpid(), s);
		if (gpx_export_remote(c[h], reg[h], name, &o, NULL) != 0) {
			fprintf(stderr, "export %s: %s\n", name, gpx_last_error(c[h]));
			continue;
		}
		double t0 = now(), first;
		double t = poll_all(c, n, h, name, false, t0, &first);
		if (t >= 0) {
			all[k] = t;
			one[k++] = first;
		}
		gpx_unexport(c[h], name);
	}
	qsort(all, k, sizeof(double), cmp_double);
	qsort(one, k, sizeof(double), cmp_double);
	printf("export -> visible on all %d other nodes: %d samples, p50 %.1f ms, p99 %.1f ms, max %.1f ms\n",
	    n - 1, k, pct(all, k, .5) * 1e3, pct(all, k, .99) * 1e3, all[k - 1] * 1e3);
	printf("export -> visible on the first other node: p50 %.1f ms, p99 %.1f ms\n", pct(one, k, .5) * 1e3,
	    pct(one, k, .99) * 1e3);
	return k == samples ? 0 : 1;
}

static int
death(const char *dir, int n, int victim, const char *name)
{
	gpx_conn **c = connect_all(dir, n);
	char line[16];
	double first;

	if (fgets(line, sizeof(line), stdin) == NULL)
		return 1;
	double t0 = now();
	double t = poll_all(c, n, victim, name, true, t0, &first);
	if (t < 0) {
		printf("death: not seen by every node within 30 s\n");
		return 1;
	}
	printf("death of node %d -> seen by all %d others: %.2f s (the first: %.2f s)\n", victim, n - 1, t, first);
	return 0;
}

int
main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc == 5 && strcmp(argv[1], "load") == 0)
		return load(argv[2], argv[3], atoi(argv[4]));
	if (argc == 5 && strcmp(argv[1], "visible") == 0)
		return visible(argv[2], atoi(argv[3]), atoi(argv[4]));
	if (argc == 6 && strcmp(argv[1], "death") == 0)
		return death(argv[2], atoi(argv[3]), atoi(argv[4]), argv[5]);
	fprintf(stderr, "usage: cluster-scale load SOCK PREFIX COUNT | visible SOCKDIR N SAMPLES | "
	    "death SOCKDIR N VICTIM NAME\n");
	return 2;
}
