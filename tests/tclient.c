/*
 * Helpers of the test programs that drive a real gpxd through libgpxclient (tclient.h).
 */
#include "config.h"

#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/mman.h>

#include "proto/ring.h"
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

/* ---- a raw client with a ring (tclient.h) ---- */

int
raw_open_on(struct raw *w, const struct harness *h, uint32_t version)
{
	int ring_fd;

	memset(w, 0, sizeof(*w));
	w->seq = 10;
	if ((w->sock = harness_connect(h)) < 0 || (w->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
		return -1;
	Gpx__DaemonMsg *m = harness_hello(w->sock, version, w->efd, &ring_fd);
	if (m == NULL || m->reply->status != 0 || ring_fd < 0 || m->reply->welcome->version != version) {
		if (m)
			gpx__daemon_msg__free_unpacked(m, NULL);
		return -1;
	}
	w->entries = m->reply->welcome->ring_entries;
	gpx__daemon_msg__free_unpacked(m, NULL);
	w->ring_len = gpx_ring_size(w->entries);
	w->ring = mmap(NULL, w->ring_len, PROT_READ | PROT_WRITE, MAP_SHARED, ring_fd, 0);
	close(ring_fd);
	if (w->ring == MAP_FAILED || buf_new(&w->mem, 65536) < 0)
		return -1;

	if (raw_send_register(w, w->mem.fd, w->mem.len) == 0 ||
	    (m = harness_recv(w->sock, WAIT_MS, NULL, NULL, NULL)) == NULL)
		return -1;
	int r = m->reply->status == 0 && m->reply->body_case == GPX__REPLY__BODY_REGISTERED ? 0 : -1;
	if (r == 0)
		w->region = m->reply->registered->region;
	gpx__daemon_msg__free_unpacked(m, NULL);
	return r;
}

int
raw_kick(struct raw *w, uint64_t tail)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__SqKick k = GPX__SQ_KICK__INIT;

	__atomic_store_n(&w->ring->sq_tail, tail, __ATOMIC_RELEASE);
	m.seq = ++w->seq;
	m.body_case = GPX__CLIENT_MSG__BODY_SQ_KICK;
	m.sq_kick = &k;
	return harness_send(w->sock, &m, NULL, 0) < 0 ? -1 : 0;
}

uint32_t
raw_send_register(struct raw *w, int fd, uint64_t len)
{
	Gpx__ClientMsg cm = GPX__CLIENT_MSG__INIT;
	Gpx__Register reg = GPX__REGISTER__INIT;

	reg.kind = GPX__MEM_KIND__MEM_HOST;
	reg.length = len;
	cm.seq = ++w->seq;
	cm.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	cm.register_ = &reg;
	return harness_send(w->sock, &cm, &fd, 1) < 0 ? 0 : cm.seq;
}

int
raw_open_v(struct raw *w, uint32_t version)
{
	return raw_open_on(w, &H, version);
}

int
raw_open(struct raw *w)
{
	return raw_open_v(w, GPX_PROTO_VERSION);
}

void
raw_close(struct raw *w)
{
	if (w->ring != NULL && w->ring != MAP_FAILED)
		munmap(w->ring, w->ring_len);
	if (w->sock >= 0)
		close(w->sock);
	if (w->efd >= 0)
		close(w->efd);
	if (w->mem.p != NULL)
		buf_free(&w->mem);
}

uint64_t
ring_head(struct raw *w)
{
	return __atomic_load_n(&w->ring->head, __ATOMIC_ACQUIRE);
}

bool
wait_head(struct raw *w, uint64_t want)
{
	for (int i = 0; i < WAIT_MS && ring_head(w) < want; i++) {
		struct pollfd p = { .fd = w->efd, .events = POLLIN };
		uint64_t v;
		if (poll(&p, 1, 1) == 1)
			(void)!read(w->efd, &v, sizeof(v));
	}
	return ring_head(w) == want;
}

/* gpxd's status, unpacked (free with gpx__query_reply__free_unpacked); NULL if it did not answer. */
Gpx__QueryReply *
status_query(gpx_conn *c)
{
	void *buf;
	size_t len;

	if (gpx_query(c, GPX_Q_STATUS, &buf, &len) < 0)
		return NULL;
	Gpx__QueryReply *q = gpx__query_reply__unpack(NULL, len, buf);
	free(buf);
	if (q != NULL && q->status == NULL) {
		gpx__query_reply__free_unpacked(q, NULL);
		q = NULL;
	}
	return q;
}

