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
 * disconnected by the loop.  It is not rung at all while the client says a thread of it spins
 * on the ring (cq_spinners, proto/ring.h): that thread sees the record within a few hundred
 * nanoseconds, and the write, with the wake-up it may cost, stays off the copy worker's path.
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

#include "daemon/gpxd.h"

static void (*cq_broken_hook)(struct cq *);
static _Atomic uint64_t doorbells_rung, doorbells_skipped, doorbells_early, doorbell_writes;

void
cq_doorbell_stats(uint64_t *rung, uint64_t *skipped, uint64_t *early, uint64_t *writes)
{
	*writes = atomic_load_explicit(&doorbell_writes, memory_order_relaxed);
	*rung = atomic_load_explicit(&doorbells_rung, memory_order_relaxed);
	*skipped = atomic_load_explicit(&doorbells_skipped, memory_order_relaxed);
	*early = atomic_load_explicit(&doorbells_early, memory_order_relaxed);
}

void
cq_set_broken_hook(void (*fn)(struct cq *))
{
	cq_broken_hook = fn;
}

struct cq *
cq_new(uint32_t entries, int efd, uint64_t client, char *err, size_t errlen)
{
	struct cq *q = aligned_alloc(64, (sizeof(*q) + 63) & ~(size_t)63);

	if (q == NULL) {
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	memset(q, 0, sizeof(*q));
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
	q->ring->sq_wakeup = 1;      /* until the loop polls, submissions need a kick */
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
	if (q->map_counted)
		maps_give();
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
		/* Said by the loop when it disconnects the client (any thread may get here). */
		q->broken_why = why;
		q->broken = true;
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
cq_warm(const struct cq *q)
{
	__builtin_prefetch(&q->lock, 1);        /* (and inflight, head) */
	__builtin_prefetch(&q->refs, 1);        /* (and the counts) */
	__builtin_prefetch(&q->ring->tail, 0);
}

bool
cq_busy(struct cq *q)
{
	bool busy;

	pthread_mutex_lock(&q->lock);
	busy = q->inflight > 0;
	pthread_mutex_unlock(&q->lock);
	return busy;
}

void
cq_unreserve(struct cq *q)
{
	pthread_mutex_lock(&q->lock);
	q->inflight--;
	pthread_mutex_unlock(&q->lock);
}

/*
 * Doorbells never block the daemon.  The eventfd's file description is shared with the client,
 * which may make it blocking and fill its counter, and then write() would block the calling
 * thread (a copy worker) for good.  So each thread that rings doorbells publishes when its
 * current write began, and a sentinel thread, waking every few milliseconds, interrupts a write
 * older than DOORBELL_TIMEOUT_NS with a signal that nothing handles (and that does not restart
 * system calls): the write fails with EINTR and the client is disconnected.  On the fast path a
 * doorbell costs an fcntl, a write and two clock reads; a full non-blocking counter fails at once.
 */
#define DOORBELL_TIMEOUT_NS 10000000ULL
#define DOORBELL_THREADS 512     /* every copy worker, GPU worker and the loop */

struct db_slot {
	pthread_t thread;
	_Atomic uint64_t since;      /* start of the write in progress (ns), or 0 */
};

static struct db_slot db_slots[DOORBELL_THREADS];
static atomic_int db_nslots;
/* The sentinel, after DB_QUIET_TICKS ticks without a doorbell, waits for the next one instead
 * of ticking (an idle daemon wakes for nothing): the ringer that finds it parked wakes it. */
#define DB_QUIET_TICKS 200
static atomic_bool db_parked;
static pthread_mutex_t db_park_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t db_park_cond = PTHREAD_COND_INITIALIZER;
static __thread struct db_slot *db_self;
static pthread_once_t db_once = PTHREAD_ONCE_INIT;

static void
db_alarm(int sig)
{
	(void)sig;
}

static void *
db_sentinel(void *unused)
{
	struct timespec tick = { 0, 5000000 };
	uint64_t rung = 0;
	int quiet = 0;

	(void)unused;
	thread_name("doorbell");
	for (;;) {
		nanosleep(&tick, NULL);
		uint64_t now = now_ns();
		int n = atomic_load(&db_nslots);
		bool busy = false;
		for (int i = 0; i < n; i++) {
			uint64_t since = atomic_load(&db_slots[i].since);
			busy |= since != 0;
			if (since != 0 && now - since > DOORBELL_TIMEOUT_NS)
				pthread_kill(db_slots[i].thread, SIGRTMIN + 1);
		}
		const uint64_t r = atomic_load_explicit(&doorbells_rung, memory_order_relaxed) +
		    atomic_load_explicit(&doorbells_early, memory_order_relaxed);
		quiet = busy || r != rung ? 0 : quiet + 1;
		rung = r;
		if (quiet < DB_QUIET_TICKS)
			continue;
		/* Park.  A ringer stores its `since` before it looks at db_parked, this thread stores
		 * db_parked before it looks at every `since` again: one of the two sees the other. */
		pthread_mutex_lock(&db_park_lock);
		atomic_store(&db_parked, true);
		n = atomic_load(&db_nslots);     /* (a thread's first ring registers it first) */
		for (int i = 0; i < n; i++)
			if (atomic_load(&db_slots[i].since) != 0)
				atomic_store(&db_parked, false);
		while (atomic_load(&db_parked))
			pthread_cond_wait(&db_park_cond, &db_park_lock);
		pthread_mutex_unlock(&db_park_lock);
		quiet = 0;
	}
	return NULL;
}

static void
db_start(void)
{
	pthread_t t;

	cq_signal_init();
	if (pthread_create(&t, NULL, db_sentinel, NULL) == 0)
		pthread_detach(t);
	else
		log_warn("doorbell sentinel");
}

void
cq_signal_init(void)
{
	struct sigaction sa = { .sa_handler = db_alarm };

	sigemptyset(&sa.sa_mask);
	sa.sa_flags = 0;         /* no SA_RESTART: the blocked write must fail with EINTR */
	sigaction(SIGRTMIN + 1, &sa, NULL);
}

/* The calling thread's slot, registered on its first doorbell; NULL if the table is full. */
static struct db_slot *
db_slot(void)
{
	if (db_self == NULL) {
		pthread_once(&db_once, db_start);
		int i = atomic_fetch_add(&db_nslots, 1);
		if (i >= DOORBELL_THREADS) {
			atomic_fetch_sub(&db_nslots, 1);
			return NULL;
		}
		db_slots[i].thread = pthread_self();
		db_self = &db_slots[i];
	}
	return db_self;
}

/*
 * Adds n to q's eventfd counter, one for each record (n records posted together: one write),
 * unless a thread of the client looks at the ring: whether it wrote.
 */
static bool
doorbell(struct cq *q, uint64_t n)
{
	/* The record's head is published; a spinner that lowers cq_spinners after this load
	 * looks at the ring once more and sees it (the fence pairs with the client's). */
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (__atomic_load_n(&q->ring->cq_spinners, __ATOMIC_RELAXED) != 0)
		return false;

	struct db_slot *me = db_slot();
	uint64_t t0 = now_ns();
	ssize_t w;

	/* A client may clear O_NONBLOCK (to block in read, say): put it back, so that a full
	 * counter fails at once; only a client racing this fcntl is left to the sentinel. */
	int fl = fcntl(q->efd, F_GETFL);
	if (fl >= 0 && !(fl & O_NONBLOCK))
		fcntl(q->efd, F_SETFL, fl | O_NONBLOCK);
	if (me != NULL)
		atomic_store(&me->since, t0);
	if (atomic_load(&db_parked) && atomic_exchange(&db_parked, false)) {
		pthread_mutex_lock(&db_park_lock);     /* the sentinel watches this write */
		pthread_cond_signal(&db_park_cond);
		pthread_mutex_unlock(&db_park_lock);
	}
	do
		w = write(q->efd, &n, sizeof(n));
	while (w < 0 && errno == EINTR && now_ns() - t0 < DOORBELL_TIMEOUT_NS);   /* a stale signal */
	if (me != NULL)
		atomic_store(&me->since, 0);
	if (w != sizeof(n)) {
		pthread_mutex_lock(&q->lock);
		cq_break(q, "its eventfd cannot take a doorbell (counter full, or blocking)");
		pthread_mutex_unlock(&q->lock);
	}
	return true;
}

/* The doorbell of n records posted together. */
static void
cq_ring_doorbell(struct cq *q, uint64_t n)
{
	if (doorbell(q, n)) {
		atomic_fetch_add_explicit(&doorbells_rung, n, memory_order_relaxed);
		atomic_fetch_add_explicit(&doorbell_writes, 1, memory_order_relaxed);
	} else
		atomic_fetch_add_explicit(&doorbells_skipped, n, memory_order_relaxed);
}

/* Whether a thread of q's client says it sleeps in a wait (cq_sleepers): a hint, read unordered. */
bool
cq_asleep(const struct cq *q)
{
	return __atomic_load_n(&q->ring->cq_sleepers, __ATOMIC_RELAXED) != 0 &&
	    !__atomic_load_n(&q->broken, __ATOMIC_RELAXED);
}

/*
 * A record is due soon: a client thread asleep in a wait is woken now, with no record, so that
 * it spins when the record comes (engine_chunk_soon).  A wake missed or spent costs that thread
 * a little time only.
 */
void
cq_wake(struct cq *q)
{
	if (cq_asleep(q) && doorbell(q, 1))
		atomic_fetch_add_explicit(&doorbells_early, 1, memory_order_relaxed);
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

/*
 * The records of posts e[0..n) that name q, in their order, under one hold of q's lock, and
 * then one doorbell for all of them: one write that adds their number to the client's eventfd
 * (none when the queue is broken: its client is on its way out).  Their entries are cleared
 * (q NULL); each held a reference on q, dropped here.
 */
static void
post_run(struct cq *q, struct cq_post *e, int n)
{
	int refs = 0, written = 0;

	pthread_mutex_lock(&q->lock);
	for (int i = 0; i < n; i++) {
		if (e[i].q != q)
			continue;
		q->inflight--;
		if (!q->broken) {
			cq_write(q, e[i].tag, e[i].status, e[i].bytes, 0, 0);
			written++;
		}
		e[i].q = NULL;
		refs++;
	}
	pthread_mutex_unlock(&q->lock);
	if (written > 0)
		cq_ring_doorbell(q, written);
	while (refs-- > 0)
		cq_unref(q);
}

void
cq_posts_add(struct cq_posts *p, struct cq *q, uint64_t tag, int status, uint64_t bytes)
{
	if (p->n == CQ_POSTS_MAX)
		cq_posts_flush(p);
	p->e[p->n++] = (struct cq_post){ .q = q, .tag = tag, .status = status, .bytes = bytes };
}

void
cq_posts_flush(struct cq_posts *p)
{
	for (int i = 0; i < p->n; i++)
		if (p->e[i].q != NULL)
			post_run(p->e[i].q, &p->e[i], p->n - i);
	p->n = 0;
}

void
cq_post(struct cq *q, uint64_t tag, int status, uint64_t bytes)
{
	struct cq_post one = { .q = q, .tag = tag, .status = status, .bytes = bytes };

	cq_ref(q);     /* (the caller keeps its own) */
	post_run(q, &one, 1);
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
		cq_ring_doorbell(q, 1);
}
