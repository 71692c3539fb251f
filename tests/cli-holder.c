/*
 * cli-holder: a client that holds state in gpxd while tests/cli.test looks at it with gpxctl.
 * It registers two 16 MiB memfds, exports one under NAME (rule any, notify on), queues a few
 * copies, prints "READY <client id>" on stdout, and keeps its connection until stdin closes.
 * Meanwhile it takes commands on stdin, a line each, and answers each with a line:
 *
 *   busy     queues a copy of 1 TiB (65,536 segments of 16 MiB), tag 4242, that runs for
 *            minutes: "BUSY <status>"
 *   cancel   cancels it and waits for its end: "CANCELLED <its status>"
 *   copy     one copy of 4 KiB, waited for: "COPY <status>"
 *
 * usage: cli-holder SOCKET NAME
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client-lib/gpx.h"

#define BUSY_TAG 4242
#define BUSY_SEGS 65536

int
main(int argc, char **argv)
{
	const size_t len = 16u << 20;
	struct gpx_export_opts eo = { .rule = GPX_EXPORT_ANY, .notify = 1, .notify_tag = 1 };
	gpx_region a, b;
	gpx_conn *c;
	void *pa, *pb;
	int fa, fb, r;
	char line[64];
	static struct gpx_seg segs[BUSY_SEGS];
	struct gpx_completion done;

	if (argc != 3) {
		fprintf(stderr, "usage: cli-holder SOCKET NAME\n");
		return 2;
	}
	if ((r = gpx_connect(argv[1], "cli-holder", &c)) < 0 || (r = gpx_host_alloc(len, &fa, &pa)) < 0 ||
	    (r = gpx_host_alloc(len, &fb, &pb)) < 0 || (r = gpx_register_host(c, fa, 0, len, 0, &a)) < 0 ||
	    (r = gpx_register_host(c, fb, 0, len, GPX_REG_READONLY, &b)) < 0 ||
	    (r = gpx_export(c, a, argv[2], &eo)) < 0) {
		fprintf(stderr, "cli-holder: %s\n", gpx_strerror(r));
		return 1;
	}
	for (int t = 0; t < 8; t++)
		if ((r = gpx_copy(c, b, 0, a, 0, len, t)) < 0) {
			fprintf(stderr, "cli-holder: copy: %s\n", gpx_strerror(r));
			return 1;
		}
	printf("READY %llu\n", (unsigned long long)gpx_client_id(c));
	fflush(stdout);
	for (int i = 0; i < BUSY_SEGS; i++)
		segs[i] = (struct gpx_seg){ 0, 0, len };
	while (fgets(line, sizeof(line), stdin) != NULL) {
		if (strcmp(line, "busy\n") == 0)
			printf("BUSY %d\n", gpx_copyv(c, b, a, segs, BUSY_SEGS, BUSY_TAG));
		else if (strcmp(line, "cancel\n") == 0) {
			r = gpx_cancel(c, BUSY_TAG);
			r = r == 0 || r == -GPX_ENOENT ? gpx_wait_tag(c, BUSY_TAG, &done, 60000) : r;
			printf("CANCELLED %d\n", r < 0 ? r : done.status);
		} else if (strcmp(line, "copy\n") == 0)
			printf("COPY %d\n", gpx_copy_sync(c, b, 0, a, 0, 4096));
		else
			printf("UNKNOWN\n");
		fflush(stdout);
	}
	gpx_close(c);
	return 0;
}
