/*
 * Memory registered with the RDMA devices.  A local region used by a transfer is registered
 * once per device (ibv_reg_mr) and kept in a cache keyed by the region and device, like the
 * GPU driver's mapping cache, until its mapping closes (fabric_rdma_region_gone, from
 * region_unuse through region_on_gone, before any kind's close).  An export is
 * registered again for each import of it, on each device, with the rights of that import only
 * (REMOTE_READ, plus REMOTE_WRITE when it is writable), and its rkeys are handed to the peer in
 * ImportRep, by device: an rkey is valid for that import on that connection and dies with the
 * Release, with the connection (every handle of the epoch is dropped) or with the region's
 * mapping.  The NIC enforces the bounds of the registration, so a peer's address and length
 * reach nothing else; the registration starts at iova 0 where the device allows it, so the
 * peer learns no address of ours.
 *
 * GPU memory (GPUDirect RDMA) is registered only on its GPU's NIC, from a dma-buf that the
 * driver exports for the range (ibv_reg_dmabuf_mr, no kernel module needed), else from the
 * device pointer itself (ibv_reg_mr, which only nvidia-peermem makes work); when neither
 * works the registration fails here, the failure is cached with the region, and the caller
 * stages the chunk through host buffers (stage.c).  No machine of this project has both a GPU
 * and an RDMA NIC: these two registrations have never run.
 *
 * Threads: the registrations are made on the loop thread; the list is under mlock because
 * fabric_rdma_region_gone may come from any thread that drops a region's last user.
 */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/fabric/rdma.h"
#ifdef HAVE_CUDA
#include "daemon/gpu/gpu.h"
#endif

/* A registration: a local region's (h == NULL, the cache) or one import of an export. */
struct rmr {
	TAILQ_ENTRY(rmr) entry;
	struct region *r;
	int dev;                     /* the device it is registered on */
	struct ibv_mr *mr;
	struct phandle *h;
	const struct peer *p;        /* the importer, only compared */
	bool writable;               /* local: LOCAL_WRITE (may be an RDMA READ's destination) */
	/* a local region in GPU memory that the NIC cannot register: mr is NULL, it is staged */
};

static pthread_mutex_t mlock = PTHREAD_MUTEX_INITIALIZER;
static TAILQ_HEAD(, rmr) mrs = TAILQ_HEAD_INITIALIZER(mrs);
static uint64_t gpu_dmabuf, gpu_peermem, gpu_none;   /* GPU memory registrations, by how */

/*
 * r's GPU memory for device d's NIC, at iova: from the dma-buf the driver exports for the
 * pages around it, else from the device pointer (nvidia-peermem).  NULL when neither works.
 * A driver call on the loop thread, once per region and import (its result is kept).
 */
static struct ibv_mr *
gpu_reg(const struct region *r, const struct rdev *d, uint64_t iova, int acc)
{
#ifndef HAVE_CUDA
	(void)r, (void)d, (void)iova, (void)acc;
	return NULL;
#else
	uint64_t off, size;
	struct ibv_mr *mr = NULL;
	int fd = cuda_use(r->dev) == 0 ? cuda_dmabuf(r->dptr, r->length, &off, &size) : -1;

	if (fd >= 0) {
		mr = ibv_reg_dmabuf_mr(d->pd, off, r->length, iova, fd, acc);
		close(fd);              /* the registration holds the dma-buf */
		if (mr != NULL) {
			gpu_dmabuf++;
			return mr;
		}
	}
	if ((mr = ibv_reg_mr_iova(d->pd, (void *)(uintptr_t)r->dptr, r->length, iova, acc)) != NULL) {
		gpu_peermem++;
		return mr;
	}
	gpu_none++;
	log_warnx("fabric: %s cannot register %llu bytes of GPU %d memory (dma-buf: %s; peermem: %s): "
	    "they are staged through host buffers", d->name, (unsigned long long)r->length, r->dev,
	    fd >= 0 ? "refused by the NIC" : "none from the driver", strerror(errno));
	return NULL;
#endif
}

void
fabric_rdma_gpu_regs(uint64_t *dmabuf, uint64_t *peermem, uint64_t *none)
{
	*dmabuf = gpu_dmabuf;
	*peermem = gpu_peermem;
	*none = gpu_none;
}

/*
 * On every device that may carry the region (host memory: all; GPU memory: its GPU's NIC
 * only), for this import alone.  iova 0: the peer addresses the export by offset and learns
 * no address of ours; a device that cannot take an iova gets no registration, unless none
 * can, when the last takes the region at its address.
 */
bool
fabric_rdma_export(struct peer *p, struct phandle *h, uint64_t *addr, uint32_t rkeys[FABRIC_RDMA_DEVS])
{
	struct region *r = h->r;
	int acc = IBV_ACCESS_REMOTE_READ, only = rdev_for(r), n = 0;

	memset(rkeys, 0, sizeof(uint32_t) * FABRIC_RDMA_DEVS);
	*addr = 0;
	if (!rdevs.on || r->length == 0 || only == -2)
		return false;
	if (!h->read_only && !r->read_only)
		acc |= IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
	for (int i = 0; i < rdevs.n; i++) {
		struct rdev *d = &rdevs.d[i];
		struct rmr *m;
		if ((only >= 0 && i != only) || (m = calloc(1, sizeof(*m))) == NULL)
			continue;
		if (r->host == NULL)
			m->mr = gpu_reg(r, d, 0, acc);
		else if ((m->mr = ibv_reg_mr_iova(d->pd, r->host, r->length, 0, acc)) == NULL && n == 0 &&
		    i == rdevs.n - 1 && (m->mr = ibv_reg_mr(d->pd, r->host, r->length, acc)) != NULL)
			*addr = (uintptr_t)r->host;
		if (m->mr == NULL) {
			log_warn("fabric: peer %s: registering export %s (%llu bytes) on %s", p->node,
			    h->export_name, (unsigned long long)r->length, d->name);
			free(m);
			continue;
		}
		m->r = r;
		m->h = h;
		m->p = p;
		m->dev = i;
		rkeys[i] = m->mr->rkey;
		n++;
		pthread_mutex_lock(&mlock);
		TAILQ_INSERT_TAIL(&mrs, m, entry);
		pthread_mutex_unlock(&mlock);
	}
	if (n == 0)
		log_warnx("fabric: peer %s: export %s is not registered for rdma: it goes over tcp%s", p->node,
		    h->export_name, r->host ? "" : ", staged");
	return n > 0;
}

void
fabric_rdma_unexport(struct phandle *h)
{
	TAILQ_HEAD(, rmr) gone = TAILQ_HEAD_INITIALIZER(gone);
	struct rmr *m, *t;

	pthread_mutex_lock(&mlock);
	TAILQ_FOREACH_SAFE(m, &mrs, entry, t)
		if (m->h == h) {
			TAILQ_REMOVE(&mrs, m, entry);
			TAILQ_INSERT_TAIL(&gone, m, entry);
		}
	pthread_mutex_unlock(&mlock);
	while ((m = TAILQ_FIRST(&gone)) != NULL) {
		TAILQ_REMOVE(&gone, m, entry);
		ibv_dereg_mr(m->mr);
		free(m);
	}
}

/* The cached registration of a local region on device d, made on first use; NULL if it cannot be. */
struct ibv_mr *
rmr_local(struct region *r, int d, bool write_into)
{
	struct rmr *m;
	struct ibv_mr *mr = NULL;

	pthread_mutex_lock(&mlock);
	TAILQ_FOREACH(m, &mrs, entry)
		if (m->r == r && m->h == NULL && m->dev == d && (m->writable || !write_into)) {
			mr = m->mr;
			break;
		}
	pthread_mutex_unlock(&mlock);
	if (m != NULL || (write_into && r->read_only))
		return mr;
	if ((m = calloc(1, sizeof(*m))) == NULL)
		return NULL;
	m->writable = !r->read_only;
	m->dev = d;
	m->r = r;
	if (r->host == NULL)
		/* Cached even when it fails: the chunks of this region are staged from now on. */
		m->mr = gpu_reg(r, &rdevs.d[d], r->dptr, m->writable ? IBV_ACCESS_LOCAL_WRITE : 0);
	else if ((m->mr = ibv_reg_mr(rdevs.d[d].pd, r->host, r->length,
	    m->writable ? IBV_ACCESS_LOCAL_WRITE : 0)) == NULL) {
		log_warn("fabric: registering a %llu-byte region for rdma on %s", (unsigned long long)r->length,
		    rdevs.d[d].name);
		free(m);
		return NULL;
	}
	pthread_mutex_lock(&mlock);
	TAILQ_INSERT_TAIL(&mrs, m, entry);
	pthread_mutex_unlock(&mlock);
	return m->mr;
}

/* Any thread: r's mapping is closing; every registration of it goes (the cache's and exports'). */
void
fabric_rdma_region_gone(struct region *r)
{
	TAILQ_HEAD(, rmr) gone = TAILQ_HEAD_INITIALIZER(gone);
	struct rmr *m, *t;

	pthread_mutex_lock(&mlock);
	TAILQ_FOREACH_SAFE(m, &mrs, entry, t)
		if (m->r == r) {
			TAILQ_REMOVE(&mrs, m, entry);
			TAILQ_INSERT_TAIL(&gone, m, entry);
		}
	pthread_mutex_unlock(&mlock);
	while ((m = TAILQ_FIRST(&gone)) != NULL) {
		TAILQ_REMOVE(&gone, m, entry);
		if (m->mr != NULL)
			ibv_dereg_mr(m->mr);
		free(m);
	}
}

uint32_t
fabric_rdma_regs(const struct peer *p)
{
	struct rmr *m;
	uint32_t n = 0;

	pthread_mutex_lock(&mlock);
	TAILQ_FOREACH(m, &mrs, entry)
		n += m->p == p;
	pthread_mutex_unlock(&mlock);
	return n;
}

/* After every peer is down. */
void
rmr_shutdown(void)
{
	struct rmr *m;

	pthread_mutex_lock(&mlock);
	while ((m = TAILQ_FIRST(&mrs)) != NULL) {
		TAILQ_REMOVE(&mrs, m, entry);
		if (m->mr != NULL)
			ibv_dereg_mr(m->mr);
		free(m);
	}
	pthread_mutex_unlock(&mlock);
	gpu_dmabuf = gpu_peermem = gpu_none = 0;
}
