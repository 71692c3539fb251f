/*
 * gpx-example: the smallest complete client of libgpxclient.  Connects to gpxd, allocates two
 * memfd buffers, registers them, has the daemon copy one into the other, checks the bytes.
 * Usage: gpx-example [SOCKET]   (default: $GPX_SOCKET, else /run/gpx/gpxd.sock)
 * Outside the source tree: #include <gpx/gpx.h>, cc example.c $(pkg-config --cflags --libs gpxclient)
 */
#include <stdio.h>
#include <string.h>

#include "gpx.h"

#define LEN (16u << 20)

static int
fail(gpx_conn *c, int err, const char *what)
{
	fprintf(stderr, "gpx-example: %s: %s (%s)\n", what, gpx_strerror(err), c ? gpx_last_error(c) : "");
	return 1;
}

int
main(int argc, char **argv)
{
	gpx_conn *c = NULL;
	gpx_region src, dst;
	int sfd, dfd, r;
	void *s, *d;

	if ((r = gpx_connect(argc > 1 ? argv[1] : NULL, "gpx-example", &c)) < 0)
		return fail(NULL, r, "connect");
	if ((r = gpx_host_alloc(LEN, &sfd, &s)) < 0 || (r = gpx_host_alloc(LEN, &dfd, &d)) < 0)
		return fail(c, r, "gpx_host_alloc");
	for (size_t i = 0; i < LEN; i++)
		((unsigned char *)s)[i] = (unsigned char)(i * 7 + i / 4096);
	memset(d, 0, LEN);
	if ((r = gpx_register_host(c, sfd, 0, LEN, GPX_REG_READONLY, &src)) < 0 ||
	    (r = gpx_register_host(c, dfd, 0, LEN, 0, &dst)) < 0)
		return fail(c, r, "gpx_register_host");
	if ((r = gpx_copy_sync(c, src, 0, dst, 0, LEN)) < 0)
		return fail(c, r, "gpx_copy_sync");
	if (memcmp(s, d, LEN) != 0) {
		fprintf(stderr, "gpx-example: the copy does not match its source\n");
		return 1;
	}
	printf("gpx-example: gpxd copied %u bytes between two registered buffers; they match\n", LEN);
	gpx_deregister(c, src);
	gpx_deregister(c, dst);
	gpx_host_free(sfd, s, LEN);
	gpx_host_free(dfd, d, LEN);
	gpx_close(c);
	return 0;
}
