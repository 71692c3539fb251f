/*
 * libgpxclient's completions: the ring gpxd writes a record into for each finished transfer
 * (proto/ring.h), the backlog of those read but not yet handed over (refusals, and records
 * gpx_wait_tag set aside), and the calls that hand them to the caller: gpx_poll, gpx_wait,
 * gpx_wait_tag, with the descriptor to sleep on (gpx_fd), the credit in use
 * (gpx_outstanding) and the notifications the ring had no room for (gpx_dropped).
 *
 * A wait looks at the ring for a while (client_wait_spin) before it sleeps in epoll on the
 * doorbell and the socket; meanwhile gpxd rings no doorbell.
 */
#include "config.h"

#include <errno.h>
#include <stdbool.h>
#include <string.h>
#include <unistd.h>
#include <sys/epoll.h>

#include "client-lib/client-private.h"

/* The body of a spin-wait loop: lets the sibling hardware thread run. */
static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

API int
gpx_fd(const gpx_conn *c)
{
	return c->epfd;
}

API unsigned
gpx_outstanding(const gpx_conn *c)
{
	return c->outstanding;
}

API uint64_t
gpx_dropped(const gpx_conn *c)
{
	return c->ring ? __atomic_load_n(&c->ring->dropped, __ATOMIC_RELAXED) : 0;
}

static void
drain_socket(gpx_conn *c)
{
	int err;
	Gpx__Reply *r;

	while ((r = client_recv(c, false, NULL, NULL, &err)) != NULL)
		client_async_reply(c, r);
}

static int
take_ring(gpx_conn *c, struct gpx_completion *out, int max)
{
	uint64_t head = __atomic_load_n(&c->ring->head, __ATOMIC_ACQUIRE);
	int n = 0;

	if (head - c->tail > c->entries)
		return -GPX_EPROTO;
	while (c->tail != head && n < max) {
		const struct gpx_cqe *e = gpx_ring_slot(c->ring, c->tail);
		out[n].tag = e->tag;
		out[n].bytes = e->bytes;
		out[n].status = -e->status;
		out[n].flags = e->flags;
		if (!(e->flags & GPX_CQE_NOTIFY) && c->outstanding > 0)
			c->outstanding--;
		c->tail++;
		n++;
	}
	if (n > 0)
		__atomic_store_n(&c->ring->tail, c->tail, __ATOMIC_RELEASE);
	return n;
}

API int
gpx_poll(gpx_conn *c, struct gpx_completion *out, int max)
{
	int n = 0;

	if (max <= 0)
		return 0;
	if (c->nback == 0 && !c->dead)
		drain_socket(c);
	if (c->nback > 0) {
		n = c->nback < (size_t)max ? (int)c->nback : max;
		memcpy(out, c->back, n * sizeof(*out));
		memmove(c->back, c->back + n, (c->nback - n) * sizeof(*out));
		c->nback -= n;
	}
	if (n < max && c->ring != NULL) {
		int k = take_ring(c, out + n, max - n);
		if (k < 0)
			return k;
		n += k;
	}
	if (n == 0 && c->dead)
		return -GPX_ECONN;
	return n;
}

static int
sleep_once(gpx_conn *c, int timeout_ms)
{
	struct epoll_event ev[2];
	int k;

	do
		k = epoll_wait(c->epfd, ev, 2, timeout_ms);
	while (k < 0 && errno == EINTR);
	if (k < 0)
		return -GPX_ESYS;
	if (k == 0)
		return -GPX_ETIMEDOUT;
	return 0;
}

static void
clear_doorbell(gpx_conn *c)
{
	uint64_t v;

	if (c->own_efd)
		(void)!read(c->efd, &v, sizeof(v));
}

/*
 * Whether a wait should look at the ring again instead of sleeping: for the first c->spin_s
 * of a wait that may block (client_wait_spin), and as long after each wake-up.  Most copies
 * of a few KiB complete within that, and being woken from epoll costs more than the copy (on
 * virtual machines 100 us and more).
 */
static bool
wait_spin(const gpx_conn *c, double *until, int timeout_ms)
{
	if (timeout_ms == 0)
		return false;
	double t = client_now();
	if (*until == 0)
		*until = t + c->spin_s;
	return t < *until;
}

/* Completions already in the ring, without reading the socket: the spin's cheap look. */
bool
client_ring_ready(const gpx_conn *c)
{
	return c->ring != NULL && __atomic_load_n(&c->ring->head, __ATOMIC_ACQUIRE) != c->tail;
}

/*
 * A thread that looks at the ring tells gpxd so (cq_spinners, proto/ring.h), and gpxd writes
 * no doorbell meanwhile.  Only with the library's own eventfd: a caller's gets one per record.
 * The fences pair with gpxd's between publishing a record and reading the count: after
 * client_spin_end the caller looks at the ring once more before it sleeps.
 */
void
client_spin_begin(gpx_conn *c)
{
	if (c->ring != NULL && c->own_efd && !c->spinning) {
		__atomic_fetch_add(&c->ring->cq_spinners, 1, __ATOMIC_SEQ_CST);
		c->spinning = true;
	}
}

void
client_spin_end(gpx_conn *c)
{
	if (c->spinning) {
		__atomic_fetch_sub(&c->ring->cq_spinners, 1, __ATOMIC_SEQ_CST);
		c->spinning = false;
	}
}

void
client_doorbell_plain(gpx_conn *c)
{
	c->own_efd = true;
}

void
client_sleep_begin(gpx_conn *c)
{
	if (c->ring != NULL && c->own_efd)
		__atomic_fetch_add(&c->ring->cq_sleepers, 1, __ATOMIC_RELAXED);
}

void
client_sleep_end(gpx_conn *c)
{
	if (c->ring != NULL && c->own_efd)
		__atomic_fetch_sub(&c->ring->cq_sleepers, 1, __ATOMIC_RELAXED);
}

double
client_wait_spin(const gpx_conn *c)
{
	return c->spin_s;
}

/*
 * Between two looks of a wait at the ring and the socket: looks at the ring until something
 * is there, the spin is over or a slice of it passed (refusals come over the socket: a long
 * spin reads it now and then), else sleeps once in epoll.  gpxd hears that the wait spins
 * from its first slice until the wait returns or is about to sleep; then this returns once
 * more without sleeping, so that the caller looks after lowering it.  1 when the ring has
 * records, 0 when the caller should look at everything again, or the sleep's error.
 */
static int
wait_more(gpx_conn *c, double *spin, int timeout_ms)
{
	if (wait_spin(c, spin, timeout_ms)) {
		const double slice = client_now() + CLIENT_SPIN_SLICE_S;
		bool ready;
		client_spin_begin(c);
		while (!(ready = client_ring_ready(c)) && wait_spin(c, spin, timeout_ms) && client_now() < slice)
			cpu_relax();
		return ready;
	}
	if (c->spinning) {
		client_spin_end(c);
		return 0;
	}
	/* Asleep, gpxd may wake it shortly before a long transfer's record is due (cq_sleepers):
	 * woken, the wait spins afresh.  (A look with no timeout does not sleep.) */
	if (timeout_ms == 0)
		return sleep_once(c, 0);
	client_sleep_begin(c);
	int r = sleep_once(c, timeout_ms);
	client_sleep_end(c);
	*spin = 0;
	return r;
}

static int
wait_any(gpx_conn *c, struct gpx_completion *out, int max, int timeout_ms)
{
	double spin = 0;

	for (;;) {
		clear_doorbell(c);
		int n = gpx_poll(c, out, max);
		if (n != 0)
			return n;
		if (!c->own_efd && c->efd >= 0) {
			/* The caller's eventfd: consume one doorbell only (it may be a semaphore). */
			uint64_t v;
			(void)!read(c->efd, &v, sizeof(v));
			if ((n = gpx_poll(c, out, max)) != 0)
				return n;
		}
		int r = wait_more(c, &spin, timeout_ms);
		if (r < 0)
			return r;
		/* Records came while it spun: taken at once, the socket and the doorbell left to
		 * the next look (nothing is lost, gpx_fd stays readable for them). */
		if (r > 0 && c->nback == 0 && (n = take_ring(c, out, max)) != 0)
			return n;
	}
}

/*
 * Records of other transfers that a wait for one tag put aside: while it spun gpxd wrote no
 * doorbell for them, and its looks read the ones written, so it writes one itself, and
 * whoever watches gpx_fd (an event loop calling gpx_poll) still hears of them.
 */
static void
ring_for_backlog(gpx_conn *c)
{
	uint64_t one = 1;

	if (c->own_efd && c->nback > 0)
		(void)!write(c->efd, &one, sizeof(one));
}

static int
wait_tag(gpx_conn *c, uint64_t tag, struct gpx_completion *out, int timeout_ms)
{
	struct gpx_completion tmp[64];
	double spin = 0;
	bool pushed = false;

	for (;;) {
		for (size_t i = 0; i < c->nback; i++)
			if (c->back[i].tag == tag && !(c->back[i].flags & GPX_COMP_NOTIFY)) {
				*out = c->back[i];
				memmove(&c->back[i], &c->back[i + 1], (c->nback - i - 1) * sizeof(*out));
				c->nback--;
				if (pushed)
					ring_for_backlog(c);
				return 0;
			}
		clear_doorbell(c);
		drain_socket(c);
		int k = c->ring ? take_ring(c, tmp, 64) : 0;
		if (k < 0)
			return k;
		for (int i = 0; i < k; i++)
			client_backlog_push(c, &tmp[i]);
		pushed |= k > 0;
		if (k > 0 || c->nback > 0) {
			bool found = false;
			/* A notification that happens to carry the same tag is not the one (and
			 * counting it would spin here forever, never sleeping, never timing out). */
			for (size_t i = 0; i < c->nback && !found; i++)
				found = c->back[i].tag == tag && !(c->back[i].flags & GPX_COMP_NOTIFY);
			if (found)
				continue;
		}
		if (c->dead)
			return -GPX_ECONN;
		if (k == 64)
			continue;
		int r = wait_more(c, &spin, timeout_ms);
		if (r < 0) {
			if (pushed)
				ring_for_backlog(c);
			return r;
		}
	}
}

/*
 * However a wait returns, gpxd no longer hears that it spins.  A record gpxd published after
 * the wait's last look and before this, it rang no doorbell for: one more look after lowering
 * the count (the fences pair with gpxd's) finds it, and rings the doorbell so that gpx_fd is
 * readable for it.
 */
static void
wait_end(gpx_conn *c)
{
	uint64_t one = 1;

	if (!c->spinning)
		return;
	client_spin_end(c);
	if (client_ring_ready(c))
		(void)!write(c->efd, &one, sizeof(one));
}

API int
gpx_wait(gpx_conn *c, struct gpx_completion *out, int max, int timeout_ms)
{
	int r = wait_any(c, out, max, timeout_ms);

	wait_end(c);
	return r;
}

API int
gpx_wait_tag(gpx_conn *c, uint64_t tag, struct gpx_completion *out, int timeout_ms)
{
	int r = wait_tag(c, tag, out, timeout_ms);

	wait_end(c);
	return r;
}
