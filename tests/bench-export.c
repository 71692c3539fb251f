/*
 * bench-export: the exporting half of gpx-bench's remote-import mode, for a node whose daemon
 * the benchmark cannot reach.  It registers an 8 MiB host buffer with this node's gpxd,
 * exports it to peers under NAME (read-write), prints "exported NAME" and waits until a TCP
 * connection arrives on PORT (the benchmark's node says it is done), or for at most TIMEOUT
 * seconds; then it closes, and the export goes with its connection.  Built with rdma-core, it
 * also serves the same buffer to raw verbs on port PORT + 1 of every RDMA address (the anchor
 * of remote-import: tests/bench-verbs.h), and says whether it does.
 *
 *   bench-export SOCK NAME PORT [TIMEOUT]
 */
#include "config.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "client-lib/gpx.h"
#ifdef HAVE_RDMA
#include "tests/bench-verbs.h"
#endif

#define LEN (8u << 20)

int
main(int argc, char **argv)
{
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY) };
	gpx_conn *c;
	gpx_region r;
	void *p;
	int fd, l, one = 1, r0;

	if (argc < 4 || argc > 5) {
		fprintf(stderr, "usage: bench-export SOCK NAME PORT [TIMEOUT]\n");
		return 2;
	}
	sa.sin_port = htons((uint16_t)atoi(argv[3]));
	if ((r0 = gpx_connect(argv[1], "bench-export", &c)) < 0 || (r0 = gpx_host_alloc(LEN, &fd, &p)) < 0 ||
	    (r0 = gpx_register_host(c, fd, 0, LEN, 0, &r)) < 0 || (r0 = gpx_export_remote(c, r, argv[2], NULL, NULL)) < 0) {
		fprintf(stderr, "bench-export: %s\n", gpx_strerror(r0));
		return 1;
	}
	memset(p, 1, LEN);
	if ((l = socket(AF_INET, SOCK_STREAM, 0)) < 0 || setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
	    bind(l, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(l, 1) < 0) {
		perror("bench-export: listen");
		return 1;
	}
	printf("exported %s\n", argv[2]);
#ifdef HAVE_RDMA
	char why[256];
	struct verbs_server *vs = verbs_serve((uint16_t)(atoi(argv[3]) + 1), p, LEN, why, sizeof(why));
	if (vs != NULL)
		printf("raw verbs on port %d\n", atoi(argv[3]) + 1);
	else
		printf("no raw verbs: %s\n", why);
#endif
	fflush(stdout);
	struct pollfd pf = { .fd = l, .events = POLLIN };
	int n = poll(&pf, 1, (argc > 4 ? atoi(argv[4]) : 60) * 1000);
	printf("%s\n", n > 0 ? "done" : "timed out");
#ifdef HAVE_RDMA
	verbs_server_stop(vs);
#endif
	gpx_close(c);
	gpx_host_free(fd, p, LEN);
	return n > 0 ? 0 : 1;
}
