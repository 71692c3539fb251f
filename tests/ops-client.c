/*
 * ops-client: the smallest client that really moves memory through gpxd, for the deployment
 * tests (socket activation, a non-root daemon, metrics, the systemd guest).  It registers two
 * memfd buffers, copies one into the other COUNT times (or for SECONDS) with a fresh pattern
 * each time, checks every byte, and reports.  Exit status: 0 when every copy arrived intact,
 * 1 on any error (printed with the daemon's explanation), 2 for bad usage.
 *
 * With -x it instead submits COUNT copies at once and cancels each right away, to make
 * transfers end with an error status (ECANCELED) on purpose; each must end either cancelled
 * or complete and intact.
 *
 * With -o it asks for one copy that reaches one byte past the destination's end: the daemon
 * must refuse it (GPX_ERANGE) with the destination untouched.
 *
 * -p MS pauses between copies, to keep a long run from hogging a slow (emulated) machine.
 *
 * usage: ops-client [-s SOCKET] [-N NAME] [-n COUNT] [-b BYTES] [-t SECONDS] [-w SECONDS]
 *                   [-p MS] [-q] [-x] [-o]
 */
#include "config.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client-lib/gpx.h"

static gpx_conn *conn;

static void
die(const char *what, int err)
{
	fprintf(stderr, "ops-client: %s: %s%s%s\n", what, gpx_strerror(err), conn ? ": " : "",
	    conn ? gpx_last_error(conn) : "");
	exit(1);
}

static double
now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* -x: COUNT copies submitted, each cancelled at once; all must end, cancelled or complete. */
static int
cancel_all(gpx_region rs, gpx_region rd, unsigned long long count, unsigned long long bytes)
{
	unsigned long long cancelled = 0, complete = 0;
	int r;

	for (unsigned long long i = 0; i < count; i++) {
		if ((r = gpx_copy(conn, rs, 0, rd, 0, bytes, i + 1)) < 0)
			die("copy", r);
		if ((r = gpx_cancel(conn, i + 1)) < 0 && r != -GPX_ENOENT)
			die("cancel", r);
	}
	while (cancelled + complete < count) {
		struct gpx_completion c[16];
		int n = gpx_wait(conn, c, 16, 10000);
		if (n <= 0)
			die("wait", n == 0 ? -GPX_ETIMEDOUT : n);
		for (int i = 0; i < n; i++) {
			if (c[i].status == -GPX_ECANCELED)
				cancelled++;
			else if (c[i].status == 0 && c[i].bytes == bytes)
				complete++;
			else
				die("a cancelled copy ended", c[i].status);
		}
	}
	printf("ops-client: %llu of %llu copies cancelled, %llu complete\n", cancelled, count, complete);
	gpx_close(conn);
	return 0;
}

int
main(int argc, char **argv)
{
	const char *sock = NULL, *name = "ops-client";
	unsigned long long count = 16, bytes = 1 << 20;
	double seconds = 0, linger = 0, pause_ms = 0;
	bool quiet = false, cancel = false, oob = false;
	int ch, r;

	while ((ch = getopt(argc, argv, "s:N:n:b:t:w:p:qxo")) != -1) {
		switch (ch) {
		case 's': sock = optarg; break;
		case 'N': name = optarg; break;
		case 'n': count = strtoull(optarg, NULL, 0); break;
		case 'b': bytes = strtoull(optarg, NULL, 0); break;
		case 't': seconds = atof(optarg); break;
		case 'w': linger = atof(optarg); break;
		case 'p': pause_ms = atof(optarg); break;
		case 'q': quiet = true; break;
		case 'x': cancel = true; break;
		case 'o': oob = true; break;
		default:
			fprintf(stderr, "usage: ops-client [-s SOCKET] [-N NAME] [-n COUNT] [-b BYTES] "
			    "[-t SECONDS] [-w SECONDS] [-p MS] [-q] [-x] [-o]\n");
			return 2;
		}
	}
	if (bytes == 0 || bytes > (1ULL << 32)) {
		fprintf(stderr, "ops-client: -b wants 1 to 4 GiB\n");
		return 2;
	}

	int sfd, dfd;
	unsigned char *src, *dst;
	gpx_region rs, rd;
	if ((r = gpx_connect(sock, name, &conn)) < 0)
		die("connect", r);
	if ((r = gpx_host_alloc(bytes, &sfd, (void **)&src)) < 0 ||
	    (r = gpx_host_alloc(bytes, &dfd, (void **)&dst)) < 0)
		die("host_alloc", r);
	if ((r = gpx_register_host(conn, sfd, 0, bytes, GPX_REG_READONLY, &rs)) < 0 ||
	    (r = gpx_register_host(conn, dfd, 0, bytes, 0, &rd)) < 0)
		die("register", r);

	if (cancel)
		return cancel_all(rs, rd, count, bytes);
	if (oob) {
		memset(src, 0xee, bytes);
		memset(dst, 0, bytes);
		r = gpx_copy_sync(conn, rs, 0, rd, 1, bytes);
		bool untouched = true;
		for (unsigned long long i = 0; i < bytes; i++)
			untouched = untouched && dst[i] == 0;
		printf("ops-client: out-of-bounds copy: %s (%s), destination %s\n", gpx_strerror(r),
		    gpx_last_error(conn), untouched ? "untouched" : "CHANGED");
		gpx_close(conn);
		return r == -GPX_ERANGE && untouched ? 0 : 1;
	}

	double t0 = now_s();
	unsigned long long done = 0;
	while (seconds > 0 ? now_s() - t0 < seconds : done < count) {
		unsigned char seed = (unsigned char)(done * 37 + 11);
		for (unsigned long long i = 0; i < bytes; i += 512)
			src[i] = (unsigned char)(seed + i / 512);
		src[bytes - 1] = seed ^ 0xa5;
		memset(dst, 0, bytes);
		if ((r = gpx_copy_sync(conn, rs, 0, rd, 0, bytes)) < 0)
			die("copy", r);
		if (memcmp(src, dst, bytes) != 0) {
			fprintf(stderr, "ops-client: copy %llu arrived corrupted\n", done);
			return 1;
		}
		done++;
		if (pause_ms > 0)
			usleep((useconds_t)(pause_ms * 1000));
	}
	double dt = now_s() - t0;
	if (!quiet)
		printf("ops-client: %llu copies of %llu bytes verified in %.3f s (client %llu)\n", done,
		    bytes, dt, (unsigned long long)gpx_client_id(conn));
	fflush(stdout);
	if (linger > 0)
		usleep((useconds_t)(linger * 1e6));

	if ((r = gpx_deregister(conn, rs)) < 0 || (r = gpx_deregister(conn, rd)) < 0)
		die("deregister", r);
	gpx_close(conn);
	gpx_host_free(sfd, src, bytes);
	gpx_host_free(dfd, dst, bytes);
	return 0;
}
