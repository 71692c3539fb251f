/*
 * cli-holder: a client that holds state in gpxd while tests/cli.test looks at it with gpxctl.
 * It registers two 16 MiB memfds, exports one under NAME (rule any, notify on), queues a few
 * copies, prints "READY <client id>" on stdout, and keeps its connection until stdin closes.
 *
 * usage: cli-holder SOCKET NAME
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "client-lib/gpx.h"

int
main(int argc, char **argv)
{
	const size_t len = 16u << 20;
	struct gpx_export_opts eo = { .rule = GPX_EXPORT_ANY, .notify = 1, .notify_tag = 1 };
	gpx_region a, b;
	gpx_conn *c;
	void *pa, *pb;
	int fa, fb, r;
	char x;

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
	while (read(0, &x, 1) > 0)
		;
	gpx_close(c);
	return 0;
}
