/*
 * Completion queues: per connection, a ring in a sealed memfd shared with the client, and the
 * client's eventfd as doorbell.  Copy workers post records directly (under the queue's lock),
 * so a completion reaches the client without a hop through the event loop.
 *
 * Credits: a transfer is accepted only when a ring slot is guaranteed for its record, counting
 * records not yet consumed by the client and transfers still in flight.  So a posted record
 * never overwrites an unread one, and a client that stops reading only stops itself.
 *
 * The doorbell never blocks the daemon: the eventfd is checked for room with poll() and
 * written non-blocking; a client that made it unwritable (full counter) is marked broken and
 * disconnected by the loop.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>

#include "gpxd.h"

static void (*cq_broken_hook)(struct cq *);

void
cq_set_broken_hook(void (*fn)(struct cq *))
{
	cq_broken_hook = fn;
}

struct cq *
cq_new(uint32_t entries, int efd, uint64_t client, char *err, size_t errlen)
{
	struct cq *q = calloc(1, sizeof(*q));

	if (q == NULL) {
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	atomic_init(&q->refs, 1);
	pthread_mutex_init(&q->lock, NULL);
	q->efd = efd;
	q->entries = entries;
	q->client = client;
	for (int p = 0; p < NPATHS; p++)
		TAILQ_INIT(&q->eq[p].jobs);
	q->ring_len = gpx_ring_size(entries);
	q->ring_fd = memfd_create("gpx-completions", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (q->ring_fd < 0 || ftruncate(q->ring_fd, q->ring_len) < 0 ||
	    (q->ring = mmap(NULL, q->ring_len, PROT_READ | PROT_WRITE, MAP_SHARED, q->ring_fd, 0)) ==
	    MAP_FAILED ||
	    fcntl(q->ring_fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		snprintf(err, errlen, "completion ring: %s", strerror(errno));
		if (q->ring != MAP_FAILED && q->ring != NULL)
			munmap(q->ring, q->ring_len);
		if (q->ring_fd >= 0)
			close(q->ring_fd);
		free(q);
		return NULL;
	}
	q->ring->magic = GPX_RING_MAGIC;
	q->ring->version = GPX_RING_VERSION;
	q->ring->entries = entries;
	q->ring->entry_size = sizeof(struct gpx_cqe);
	return q;
}

void
cq_ref(struct cq *q)
{
	atomic_fetch_add(&q->refs, 1);
}

void
cq_unref(struct cq *q)
{
	if (atomic_fetch_sub(&q->refs, 1) != 1)
		return;
	munmap(q->ring, q->ring_len);
	if (q->ring_fd >= 0)
		close(q->ring_fd);
	if (q->efd >= 0)
		close(q->efd);
	pthread_mutex_destroy(&q->lock);
	free(q);
}

/* Under the lock: records the client has not consumed, or -1 if its tail is impossible. */
static int64_t
cq_used(struct cq *q)
{
	uint64_t head = q->head;
	uint64_t tail = __atomic_load_n(&q->ring->tail, __ATOMIC_ACQUIRE);
	uint64_t used = head - tail;

	if (used > q->entries)
		return -1;
	return (int64_t)used;
}

static void
cq_break(struct cq *q, const char *why)
{
	if (!q->broken) {
		q->broken = true;
		log_warnx("client %llu: %s; disconnecting it", (unsigned long long)q->client, why);
		if (cq_broken_hook != NULL)
			cq_broken_hook(q);
	}
}

int
cq_reserve(struct cq *q)
{
	int r = 0;

	pthread_mutex_lock(&q->lock);
	int64_t used = cq_used(q);
	if (q->broken)
		r = -GPX__STATUS__EPROTO;
	else if (used < 0) {
		cq_break(q, "completion ring tail corrupted");
		r = -GPX__STATUS__EPROTO;
	} else if (q->inflight + (uint64_t)used >= q->entries)
		r = -GPX__STATUS__EBUSY;
	else
		q->inflight++;
	pthread_mutex_unlock(&q->lock);
	return r;
}

void
cq_unreserve(struct cq *q)
{
	pthread_mutex_lock(&q->lock);
	q->inflight--;
	pthread_mutex_unlock(&q->lock);
}

/*
 * The backstop against a client that races us: between the checks below and the write it can
 * clear O_NONBLOCK again and fill its counter, and then write() would block this thread (a copy
 * worker) forever.  So every doorbell write runs under a per-thread 10 ms timer whose signal
 * (handled by nothing, without SA_RESTART) makes the write return EINTR.
 */
#define DOORBELL_TIMEOUT_NS 10000000L

static __thread timer_t db_timer;
static __thread int db_timer_state;      /* 0 unset, 1 armed per write, -1 unavailable */

static void
db_alarm(int sig)
{
	(void)sig;
}

static bool
db_timer_init(void)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;
	struct sigevent ev = { .sigev_notify = SIGEV_THREAD_ID, .sigev_signo = SIGRTMIN + 1 };

	if (db_timer_state == 0) {
		pthread_once(&once, cq_signal_init);
		ev._sigev_un._tid = (pid_t)syscall(SYS_gettid);   /* sigev_notify_thread_id */
		db_timer_state = timer_create(CLOCK_MONOTONIC, &ev, &db_timer) == 0 ? 1 : -1;
		if (db_timer_state < 0)
			log_warn("doorbell timer");
	}
	return db_timer_state > 0;
}

void
cq_signal_init(void)
{
	struct sigaction sa = { .sa_handler = db_alarm };

	sigemptyset(&sa.sa_mask);
	sa.sa_flags = 0;         /* no SA_RESTART: the blocked write must fail with EINTR */
	sigaction(SIGRTMIN + 1, &sa, NULL);
}

static void
cq_ring_doorbell(struct cq *q)
{
	struct pollfd p = { .fd = q->efd, .events = POLLOUT };
	struct itimerspec on = { .it_value = { 0, DOORBELL_TIMEOUT_NS } }, off = { 0 };
	uint64_t one = 1;
	bool timed = db_timer_init();
	ssize_t n = -1;

	/* The client may have cleared O_NONBLOCK on the shared file description: put it back. */
	int fl = fcntl(q->efd, F_GETFL);
	if (fl >= 0 && !(fl & O_NONBLOCK))
		fcntl(q->efd, F_SETFL, fl | O_NONBLOCK);
	if (poll(&p, 1, 0) == 1 && (p.revents & POLLOUT)) {
		if (timed)
			timer_settime(db_timer, 0, &on, NULL);
		n = write(q->efd, &one, sizeof(one));
		if (timed)
			timer_settime(db_timer, 0, &off, NULL);
	}
	if (n != sizeof(one)) {
		pthread_mutex_lock(&q->lock);
		cq_break(q, "its eventfd cannot take a doorbell (counter full or blocking)");
		pthread_mutex_unlock(&q->lock);
	}
}

static void
cq_write(struct cq *q, uint64_t tag, int status, uint64_t bytes, uint32_t flags, uint64_t region)
{
	struct gpx_cqe *e = (struct gpx_cqe *)(q->ring + 1) + (q->head & (q->entries - 1));

	e->tag = tag;
	e->bytes = bytes;
	e->status = status;
	e->flags = flags;
	e->region = region;
	q->head++;
	__atomic_store_n(&q->ring->head, q->head, __ATOMIC_RELEASE);
}

void
cq_post(struct cq *q, uint64_t tag, int status, uint64_t bytes)
{
	pthread_mutex_lock(&q->lock);
	q->inflight--;
	if (q->broken) {
		pthread_mutex_unlock(&q->lock);
		return;
	}
	cq_write(q, tag, status, bytes, 0, 0);
	pthread_mutex_unlock(&q->lock);
	cq_ring_doorbell(q);
}

void
cq_notify(struct cq *q, uint64_t tag, uint64_t region, uint64_t bytes)
{
	bool posted = false;

	pthread_mutex_lock(&q->lock);
	int64_t used = cq_used(q);
	if (!q->broken && used >= 0 && q->inflight + (uint64_t)used < q->entries) {
		cq_write(q, tag, 0, bytes, GPX_CQE_NOTIFY, region);
		posted = true;
	} else if (!q->broken)
		__atomic_fetch_add(&q->ring->dropped, 1, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&q->lock);
	if (posted)
		cq_ring_doorbell(q);
}
