/*
 * Helpers of the test programs that drive a real gpxd through libgpxclient (tclient.h).
 */
#include "config.h"

#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "tests/tap.h"
#include "tests/tclient.h"

uint64_t
rnd(uint64_t *s)
{
	uint64_t x = *s;

	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	*s = x;
	return x * 0x2545f4914f6cdd1dULL;
}

void
shuffle(uint32_t *p, uint32_t n, uint64_t *seed)
{
	for (uint32_t i = 0; i < n; i++)
		p[i] = i;
	for (uint32_t i = n - 1; i > 0; i--) {
		uint32_t j = rnd(seed) % (i + 1), x = p[i];
		p[i] = p[j];
		p[j] = x;
	}
}

void
fill_random(void *p, size_t n, uint64_t *seed)
{
	uint64_t *w = p;

	for (size_t i = 0; i < n / 8; i++)
		w[i] = rnd(seed);
	for (size_t i = n & ~(size_t)7; i < n; i++)
		((unsigned char *)p)[i] = (unsigned char)rnd(seed);
}

int
buf_new(struct buf *b, size_t len)
{
	void *p;
	int r = gpx_host_alloc(len, &b->fd, &p);

	b->p = p;
	b->len = len;
	b->r = 0;
	return r;
}

int
buf_reg(gpx_conn *c, struct buf *b, unsigned flags)
{
	return gpx_register_host(c, b->fd, 0, b->len, flags, &b->r);
}

void
buf_free(struct buf *b)
{
	gpx_host_free(b->fd, b->p, b->len);
	b->fd = -1;
	b->p = NULL;
}

/*
 * A connected client.  gpxd closes its copy of the ring memfd just after sending the Welcome;
 * one more round trip makes sure that happened, so descriptor counts taken now are stable.
 */
gpx_conn *
client(const char *name)
{
	gpx_conn *c = NULL;
	int r = gpx_connect(H.sock, name, &c);

	if (r < 0)
		diag("gpx_connect(%s): %s", name, gpx_strerror(r));
	else
		(void)gpx_cancel(c, UINT64_MAX);
	return c;
}

int
wait_tag(gpx_conn *c, uint64_t tag, uint64_t *bytes)
{
	struct gpx_completion e;
	int r = gpx_wait_tag(c, tag, &e, WAIT_MS);

	if (r < 0)
		return r;
	if (bytes != NULL)
		*bytes = e.bytes;
	return e.status;
}

int
drain(gpx_conn *c, struct gpx_completion *out, int max, int ms)
{
	int n = 0;

	while (n < max) {
		int k = gpx_wait(c, out + n, max - n, ms);
		if (k <= 0)
			break;
		n += k;
	}
	return n;
}

void
start_gpxd(void)
{
	start_gpxd_with(NULL);
}

void
start_gpxd_with(const char *extra)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGPIPE, SIG_IGN);
	if (harness_start(&H, extra) < 0)
		tap_bail("cannot start gpxd");
}

int
finish(void)
{
	if (tap_failed)
		harness_dump_log(&H);
	harness_cleanup(&H);
	return tap_done();
}
