/*
 * VMM memory (cuda-vmm): cuMemCreate allocations, PyTorch's expandable segments among them.
 * A client reserves one range of addresses and maps physical allocations ("pieces", 2 or
 * 20 MiB each for PyTorch) into it as its cache grows, so one tensor may span many pieces.
 * gpxd mirrors each reservation a connection shows it: a range of its own of the same size,
 * in which every piece the client sends (exported as a POSIX fd) is mapped at the offset it
 * has in the client's.  A region is one window of a mirror, however many pieces it spans: the
 * copy workers, the kernels, page lists and exports see one device address.
 *
 * Pieces are named by the driver's memory block id, unique within the client's process, and
 * held per connection (a VMM fd names nothing node-wide: whoever holds it may map it).  They
 * are not shared with other connections: a connection may reach a mapping only by presenting
 * a handle of that allocation itself, and an exported fd tells nothing of its allocation
 * before it is imported (fstat shows /dev/nvidiactl for every export; the driver does not
 * promise one handle for two imports of one allocation; tests/gpu/vmm-probe looks), while the
 * block id and the addresses are the client's word, which another client could repeat.  A

 * Register lists the pieces under its range: when all are held it is answered on the loop
 * thread without a driver call; otherwise the client is told which are missing, sends them
 * (Pieces: an import and a map each, on a task thread) and asks again.  A piece lives while a
 * region uses it; pieces sent but taken up by no registration are let go after the
 * connection's next successful VMM registration, or when it closes.
 *
 * The owner may unmap and free a piece (PyTorch's empty_cache) and map another in its place.
 * gpxd's mapping keeps the old memory alive for the regions that still use it (they no longer
 * alias the owner's tensors); a new piece that overlaps one still in use starts a new
 * generation of the mirror, a second range that later registrations use.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/gpxd.h"
#include "daemon/gpu/internal.h"

#define LOOSE_MAX 65536          /* pieces a connection may hold that no region uses */

struct vmirror;

struct vpiece {
	uint64_t id, off, size;
	uint64_t handle;             /* the imported allocation */
	int refs;                    /* regions bound to it */
	bool dying;                  /* let go; mapped until a task thread unmaps it */
	bool fresh;                  /* imported, not yet bound: its first registration is no hit */
	struct vmirror *m;
};

struct vmirror {
	TAILQ_ENTRY(vmirror) entry;
	uint64_t owner;              /* the connection that showed it */
	int dev;
	uint64_t res, res_size;      /* the client's reservation */
	uint64_t va;                 /* ours, res_size bytes */
	bool current;                /* where new pieces and registrations go */
	struct vpiece **p;           /* its pieces by offset, dying ones too: all mapped */
	uint32_t n, cap;
	uint32_t loose;              /* pieces no region uses that are not let go */
};

/* A region's pieces, in r->priv. */
struct vbind {
	uint32_t n;
	struct vpiece *p[];
};

static pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;
static TAILQ_HEAD(, vmirror) mirrors = TAILQ_HEAD_INITIALIZER(mirrors);
static atomic_uint_fast64_t n_imports, n_hits;

static struct vmirror *
mirror_find(uint64_t owner, int dev, uint64_t res, uint64_t res_size)
{
	struct vmirror *m;

	TAILQ_FOREACH(m, &mirrors, entry)
		if (m->current && m->owner == owner && m->dev == dev && m->res == res && m->res_size == res_size)
			return m;
	return NULL;
}

/* A new current mirror; the one it replaces (if any) keeps its pieces for their regions. */
static struct vmirror *
mirror_new(uint64_t owner, int dev, uint64_t res, uint64_t res_size, char *err, size_t errlen)
{
	struct vmirror *m = calloc(1, sizeof(*m));

	if (m == NULL) {
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	if (cuda_vmm_reserve(res_size, &m->va) < 0) {
		snprintf(err, errlen, "cannot reserve %llu bytes of addresses to mirror the reservation",
		    (unsigned long long)res_size);
		free(m);
		return NULL;
	}
	m->owner = owner;
	m->dev = dev;
	m->res = res;
	m->res_size = res_size;
	m->current = true;
	TAILQ_INSERT_TAIL(&mirrors, m, entry);
	return m;
}

/* A mirror with no piece left goes.  vmm_lock held. */
static void
mirror_drop_empty(struct vmirror *m)
{
	if (m->n > 0)
		return;
	TAILQ_REMOVE(&mirrors, m, entry);
	cuda_vmm_unreserve(m->va, m->res_size);
	free(m->p);
	free(m);
}

/* First piece of m that ends after off. */
static uint32_t
piece_after(const struct vmirror *m, uint64_t off)
{
	uint32_t lo = 0, hi = m->n;

	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;
		if (m->p[mid]->off + m->p[mid]->size <= off)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/* The piece of m that is exactly w and not let go, or NULL. */
static struct vpiece *
piece_find(const struct vmirror *m, const struct gpx_wire_piece *w)
{
	uint32_t i = piece_after(m, w->offset);
	struct vpiece *p = i < m->n ? m->p[i] : NULL;

	return p != NULL && !p->dying && p->off == w->offset && p->size == w->size && p->id == w->id ? p : NULL;
}

static bool
piece_insert(struct vmirror *m, struct vpiece *p)
{
	uint32_t i = piece_after(m, p->off);

	if (m->n == m->cap) {
		uint32_t ncap = m->cap ? 2 * m->cap : 16;
		struct vpiece **np = realloc(m->p, ncap * sizeof(*np));
		if (np == NULL)
			return false;
		m->p = np;
		m->cap = ncap;
	}
	memmove(&m->p[i + 1], &m->p[i], (m->n - i) * sizeof(*m->p));
	m->p[i] = p;
	m->n++;
	m->loose++;          /* until a region takes it */
	p->m = m;
	return true;
}

/* Takes p out of its mirror, which may then be empty, and frees it.  vmm_lock held. */
static void
piece_detach(struct vpiece *p)
{
	struct vmirror *m = p->m;

	for (uint32_t i = piece_after(m, p->off); i < m->n; i++)
		if (m->p[i] == p) {
			memmove(&m->p[i], &m->p[i + 1], (m->n - i - 1) * sizeof(*m->p));
			m->n--;
			break;
		}
	m->loose -= p->refs == 0 && !p->dying;
	free(p);
}

/* Unmaps p and takes it out of its mirror.  vmm_lock held. */
static void
piece_unmap(struct vpiece *p)
{
	cuda_vmm_unmap(p->m->va + p->off, p->size);
	cuda_vmm_release(p->handle);
	log_debug("gpu", "released a %llu-byte VMM piece", (unsigned long long)p->size);
	piece_detach(p);
}

/* Pieces let go of together, unmapped on a task thread. */
struct dying {
	struct defer_task task;        /* queued through it (defer.c) */
	size_t n;
	struct vpiece *p[];
};

/*
 * Task thread: unmaps the dying pieces of d.  The driver calls run
 * without the lock: they took ~450 us a piece on an H100 (p50, against ~140 us with nothing
 * else going on), and under the lock they held up the loop thread's next registration, which
 * takes it to look for pieces held.  A dying piece stays in its mirror until it is unmapped:
 * nobody binds it, and a piece sent for its place starts a new generation of the mirror.
 */
static void
pieces_free_work(void *arg)
{
	struct dying *d = arg;
	double t0 = now_s();

	for (size_t i = 0; i < d->n; i++) {
		cuda_vmm_unmap(d->p[i]->m->va + d->p[i]->off, d->p[i]->size);
		cuda_vmm_release(d->p[i]->handle);
	}
	double t1 = now_s();
	pthread_mutex_lock(&vmm_lock);
	for (size_t i = 0; i < d->n; i++) {
		struct vmirror *m = d->p[i]->m;
		piece_detach(d->p[i]);
		mirror_drop_empty(m);
	}
	pthread_mutex_unlock(&vmm_lock);
	log_debug("gpu", "%zu VMM pieces let go: unmapped and released in %.1f us, then %.1f us under the lock",
	    d->n, (t1 - t0) * 1e6, (now_s() - t1) * 1e6);
}

/* A list of up to n dying pieces, or NULL. */
static struct dying *
dying_new(size_t n)
{
	struct dying *d = malloc(sizeof(*d) + n * sizeof(d->p[0]));

	if (d != NULL)
		d->n = 0;
	return d;
}

/* Hands the dying pieces of d to a task thread. */
static void
pieces_free(struct dying *d)
{
	if (d->n == 0) {
		free(d);
		return;
	}
	defer_run(&d->task, pieces_free_work, free, d);
}

/*
 * Checks the pieces a Register lists against its range: each piece whole inside the
 * reservation, the pieces back to back, and the range inside them.  Loop thread, on the
 * region's private copy.
 */
int
vmm_check(const struct region *r, char *err, size_t errlen)
{
	const struct gpx_wire_piece *p = r->pieces;
	uint64_t end;

	for (uint32_t i = 0; i < r->npieces; i++) {
		if (p[i].size == 0 || p[i].offset > r->alloc_size || p[i].size > r->alloc_size - p[i].offset ||
		    (i > 0 && p[i].offset != p[i - 1].offset + p[i - 1].size)) {
			snprintf(err, errlen, "piece %u (%llu bytes at %llu) is empty, leaves the %llu-byte "
			    "reservation or does not follow the one before", i, (unsigned long long)p[i].size,
			    (unsigned long long)p[i].offset, (unsigned long long)r->alloc_size);
			return -GPX__STATUS__EINVAL;
		}
	}
	end = p[r->npieces - 1].offset + p[r->npieces - 1].size;
	if (r->offset < p[0].offset || r->offset >= end || r->length > end - r->offset) {
		snprintf(err, errlen, "the range %llu+%llu is not inside its pieces (%llu..%llu)",
		    (unsigned long long)r->offset, (unsigned long long)r->length,
		    (unsigned long long)p[0].offset, (unsigned long long)end);
		return -GPX__STATUS__ERANGE;
	}
	return 0;
}

/*
 * Binds r to the pieces it lists if every one is held: its address is then the mirror's, and
 * no driver call was made.  Otherwise -ENOENT with the indexes of the missing ones (at most
 * GPX_MISSING_MAX) in missing[].  Any thread; the loop thread for Register.
 */
int
vmm_bind(struct region *r, uint32_t *missing, uint32_t *nmissing, char *err, size_t errlen)
{
	int dev = gpu_dev_by_uuid(r->uuid);
	struct vmirror *m;
	struct vbind *b;
	uint32_t nm = 0;

	*nmissing = 0;
	if (dev < 0) {
		snprintf(err, errlen, "no GPU with that UUID on this node");
		return -GPX__STATUS__EINVAL;
	}
	pthread_mutex_lock(&vmm_lock);
	m = mirror_find(r->owner, dev, r->alloc_id, r->alloc_size);
	for (uint32_t i = 0; i < r->npieces; i++)
		if ((m == NULL || piece_find(m, &r->pieces[i]) == NULL) && nm < GPX_MISSING_MAX)
			missing[nm++] = i;
	if (nm > 0) {
		pthread_mutex_unlock(&vmm_lock);
		*nmissing = nm;
		snprintf(err, errlen, "gpxd does not hold %s%u of the range's %u pieces: send them",
		    nm == GPX_MISSING_MAX ? "at least " : "", nm, r->npieces);
		return -GPX__STATUS__ENOENT;
	}
	if ((b = malloc(sizeof(*b) + r->npieces * sizeof(b->p[0]))) == NULL) {
		pthread_mutex_unlock(&vmm_lock);
		snprintf(err, errlen, "out of memory");
		return -GPX__STATUS__ENOMEM;
	}
	b->n = r->npieces;
	bool fresh = false;
	for (uint32_t i = 0; i < r->npieces; i++) {
		b->p[i] = piece_find(m, &r->pieces[i]);
		m->loose -= b->p[i]->refs++ == 0;
		fresh |= b->p[i]->fresh;
		b->p[i]->fresh = false;
	}
	r->priv = b;
	r->dev = dev;
	r->dptr = m->va + r->offset;
	pthread_mutex_unlock(&vmm_lock);
	if (!fresh)
		atomic_fetch_add(&n_hits, 1);
	return 0;
}

/* Loose pieces of an owner: held, used by no region, not let go.  vmm_lock held. */
static uint32_t
loose_count(uint64_t owner)
{
	struct vmirror *m;
	uint32_t n = 0;

	TAILQ_FOREACH(m, &mirrors, entry)
		if (m->owner == owner)
			n += m->loose;
	return n;
}

/*
 * Imports n pieces of the reservation (res, res_size) of device dev, one fd each (not
 * closed here), and maps each at its place in the owner's current mirror.  A piece already
 * held is passed over; one that overlaps pieces no region uses replaces them; one that
 * overlaps a piece in use (or one let go and not yet unmapped) starts a new generation of the
 * mirror.  Task thread: driver calls, under the lock so that a mirror changes in one place.
 */
int
vmm_import(uint64_t owner, int dev, uint64_t res, uint64_t res_size, const struct gpx_wire_piece *pc,
    const int *fds, uint32_t n, char *err, size_t errlen)
{
	int e = 0;

	pthread_mutex_lock(&vmm_lock);
	if (loose_count(owner) + n > LOOSE_MAX) {
		pthread_mutex_unlock(&vmm_lock);
		snprintf(err, errlen, "more than %u pieces sent and used by no registration", LOOSE_MAX);
		return -GPX__STATUS__EQUOTA;
	}
	for (uint32_t i = 0; i < n && e == 0; i++) {
		struct vmirror *m = mirror_find(owner, dev, res, res_size);
		if (m == NULL && (m = mirror_new(owner, dev, res, res_size, err, errlen)) == NULL) {
			e = -GPX__STATUS__ENOMEM;
			break;
		}
		if (piece_find(m, &pc[i]) != NULL)
			continue;
		uint32_t lo = piece_after(m, pc[i].offset), hi = lo;
		bool used = false;
		while (hi < m->n && m->p[hi]->off < pc[i].offset + pc[i].size) {
			used |= m->p[hi]->refs > 0 || m->p[hi]->dying;
			hi++;
		}
		if (used) {
			/* The owner remapped memory a region still uses: a new generation. */
			log_debug("gpu", "client %llu remapped part of a reservation in use: new mirror",
			    (unsigned long long)owner);
			m->current = false;
			if ((m = mirror_new(owner, dev, res, res_size, err, errlen)) == NULL) {
				e = -GPX__STATUS__ENOMEM;
				break;
			}
		} else
			/* Pieces no region uses, that the owner has since replaced: gone now. */
			for (; hi > lo; hi--)
				piece_unmap(m->p[lo]);
		struct vpiece *p = calloc(1, sizeof(*p));
		if (p == NULL) {
			snprintf(err, errlen, "out of memory");
			e = -GPX__STATUS__ENOMEM;
			break;
		}
		p->id = pc[i].id;
		p->off = pc[i].offset;
		p->size = pc[i].size;
		p->fresh = true;
		double t0 = now_s(), t1 = t0;
		if ((e = cuda_vmm_import(dev, fds[i], &p->handle)) < 0) {
			snprintf(err, errlen, "piece %u: the driver refused the VMM fd (stale, or of another device)", i);
		} else if ((t1 = now_s(), e = cuda_vmm_map(m->va + p->off, p->size, p->handle,
		    gpu_access_mask(dev))) < 0) {
			snprintf(err, errlen, "piece %u: the driver would not map its %llu bytes (not the "
			    "allocation's size?)", i, (unsigned long long)pc[i].size);
			cuda_vmm_release(p->handle);
		} else {
			if (piece_insert(m, p)) {
				atomic_fetch_add(&n_imports, 1);
				/* The steps timed, for what a registration costs (gpx-bench-gpu gpu-register). */
				log_debug("gpu", "imported a VMM piece of %llu bytes at %llu of client %llu's "
				    "reservation: import %.1f us, map and access %.1f us",
				    (unsigned long long)p->size, (unsigned long long)p->off, (unsigned long long)owner,
				    (t1 - t0) * 1e6, (now_s() - t1) * 1e6);
				continue;
			}
			snprintf(err, errlen, "out of memory");
			cuda_vmm_unmap(m->va + p->off, p->size);
			cuda_vmm_release(p->handle);
			e = -GPX__STATUS__ENOMEM;
		}
		free(p);
		mirror_drop_empty(m);      /* one made for this piece alone */
	}
	pthread_mutex_unlock(&vmm_lock);
	return e;
}

/*
 * The fds of a Pieces message, kept open after it is answered.  Every VMM export is an open of
 * /dev/nvidiactl, and the last close of one tears it down in the driver: ~500 us on an H100
 * (gpx-bench-gpu gpu-register), a third of a registration when the client paid it in its
 * close after the answer.  gpxd keeps its copies until the owner's next registration or its
 * end (the client has closed its own by then), and closes them on a task thread.  One message's
 * worth a connection, at most: the next Pieces lets the one before go.  Loop thread only.
 */
struct parked {
	struct defer_task task;        /* queued through it (defer.c) */
	TAILQ_ENTRY(parked) entry;
	uint64_t owner;
	uint32_t n;
	int fds[GPX_PIECES_MAX];
};
static TAILQ_HEAD(, parked) parked = TAILQ_HEAD_INITIALIZER(parked);

static void
parked_close_work(void *arg)
{
	struct parked *pk = arg;

	for (uint32_t i = 0; i < pk->n; i++)
		close(pk->fds[i]);
}

static void
unpark(uint64_t owner)
{
	struct parked *pk;

	TAILQ_FOREACH(pk, &parked, entry)
		if (pk->owner == owner) {
			TAILQ_REMOVE(&parked, pk, entry);
			defer_run(&pk->task, parked_close_work, free, pk);
			return;
		}
}

/* Takes the n fds of an answered Pieces message (n <= GPX_PIECES_MAX); they are closed later. */
void
vmm_park(uint64_t owner, const int *fds, uint32_t n)
{
	struct parked *pk = malloc(sizeof(*pk));

	unpark(owner);
	if (pk == NULL) {
		for (uint32_t i = 0; i < n; i++)
			close(fds[i]);
		return;
	}
	pk->owner = owner;
	pk->n = n;
	memcpy(pk->fds, fds, n * sizeof(*fds));
	TAILQ_INSERT_TAIL(&parked, pk, entry);
}

/* Lets go of the pieces of an owner that no region uses, and of the fds it sent.  Loop thread. */
void
vmm_sweep(uint64_t owner)
{
	struct vmirror *m;
	struct dying *d;

	unpark(owner);
	pthread_mutex_lock(&vmm_lock);
	uint32_t loose = loose_count(owner);
	if (loose == 0 || (d = dying_new(loose)) == NULL) {
		pthread_mutex_unlock(&vmm_lock);
		return;
	}
	TAILQ_FOREACH(m, &mirrors, entry)
		for (uint32_t i = 0; m->owner == owner && m->loose > 0 && i < m->n; i++)
			if (m->p[i]->refs == 0 && !m->p[i]->dying) {
				m->p[i]->dying = true;
				m->loose--;
				d->p[d->n++] = m->p[i];
			}
	pthread_mutex_unlock(&vmm_lock);
	pieces_free(d);
}

/* The region's pieces are no longer its: those no other region uses go. */
static void
vmm_close(struct region *r)
{
	struct vbind *b = r->priv;
	struct dying *d;

	if (b == NULL)
		return;
	d = dying_new(b->n);
	pthread_mutex_lock(&vmm_lock);
	for (uint32_t i = 0; i < b->n; i++) {
		struct vpiece *p = b->p[i];
		if (--p->refs > 0 || d == NULL)
			continue;      /* (without memory for the list, the owner's next sweep lets it go) */
		p->dying = true;
		d->p[d->n++] = p;
	}
	pthread_mutex_unlock(&vmm_lock);
	if (d != NULL)
		pieces_free(d);
	free(b);
	__atomic_store_n(&r->priv, NULL, __ATOMIC_RELEASE);
}

/* Loop thread: a registration all of whose pieces are held. */
static bool
vmm_try_open(struct region *r)
{
	uint32_t missing[GPX_MISSING_MAX], nm;
	char err[160];

	return r->npieces > 0 && vmm_bind(r, missing, &nm, err, sizeof(err)) == 0;
}

/*
 * Task thread: a registration of protocol 1 or 2, one piece (the whole allocation) with its
 * fd, imported and bound.
 */
static int
vmm_open(struct region *r, char *err, size_t errlen)
{
	uint32_t missing[GPX_MISSING_MAX], nm;
	int dev = gpu_dev_by_uuid(r->uuid), e;

	if (dev < 0) {
		snprintf(err, errlen, "no GPU with that UUID on this node");
		e = -GPX__STATUS__EINVAL;
	} else if ((e = vmm_import(r->owner, dev, r->alloc_id, r->alloc_size, r->pieces, &r->fd, 1, err,
	    errlen)) == 0)
		e = vmm_bind(r, missing, &nm, err, errlen);
	close(r->fd);
	r->fd = -1;
	return e;
}

const struct mem_ops mem_cuda_vmm_ops = {
	.name = "cuda-vmm", .open = vmm_open, .close = vmm_close, .try_open = vmm_try_open,
};

/* Pieces imported; registrations answered from pieces held, and the pieces held now. */
uint64_t
vmm_stats(uint64_t *hits, uint32_t *pieces)
{
	const struct vmirror *m;
	uint32_t n = 0;

	pthread_mutex_lock(&vmm_lock);
	TAILQ_FOREACH(m, &mirrors, entry)
		n += m->n;
	pthread_mutex_unlock(&vmm_lock);
	*pieces = n;
	*hits = atomic_load(&n_hits);
	return atomic_load(&n_imports);
}
