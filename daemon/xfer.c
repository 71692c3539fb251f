/*
 * From a Transfer message to a job the engine can run.  Everything a client says is checked
 * here, before a single byte moves: both regions belong to (or were imported by) this
 * connection, the destination is writable, and every segment lies inside both regions, with
 * offset + length overflow caught.  Large segment lists come in a memfd and are copied out
 * before they are checked, so the client cannot change them afterwards.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include "gpxd.h"

static int
resolve(struct conn *c, uint64_t id, const char *which, struct rhandle **out, char *err, size_t errlen)
{
	struct rhandle *h = conn_handle(c, id);

	if (h == NULL) {
		if ((uint32_t)(id >> 32) != c->epoch && id != 0) {
			snprintf(err, errlen, "%s region %#llx is not this connection's", which,
			    (unsigned long long)id);
			log_audit(c, "%s", err);
			return -GPX__STATUS__EACCES;
		}
		snprintf(err, errlen, "no %s region %#llx", which, (unsigned long long)id);
		return -GPX__STATUS__ENOENT;
	}
	if (atomic_load(&h->r->revoked)) {
		snprintf(err, errlen, "%s region %#llx was withdrawn by its owner", which,
		    (unsigned long long)id);
		return -GPX__STATUS__EREVOKED;
	}
	*out = h;
	return 0;
}

static int
segs_fd_ok(int fd, uint32_t count, char *err, size_t errlen)
{
	size_t want = (size_t)count * sizeof(struct gpx_wire_seg);
	struct stat st;

	if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || fcntl(fd, F_GET_SEALS) < 0) {
		snprintf(err, errlen, "the segment table fd is not a memfd");
		return -GPX__STATUS__EBADFD;
	}
	if ((uint64_t)st.st_size < want) {
		snprintf(err, errlen, "the segment table holds %lld bytes, %u segments need %zu",
		    (long long)st.st_size, count, want);
		return -GPX__STATUS__EINVAL;
	}
	return 0;
}

static int
read_segs(int fd, uint32_t count, struct gpx_wire_seg *segs, char *err, size_t errlen)
{
	size_t want = (size_t)count * sizeof(*segs);

	for (size_t got = 0; got < want;) {
		ssize_t n = pread(fd, (char *)segs + got, want - got, got);
		if (n <= 0) {
			snprintf(err, errlen, "reading the segment table: %s", n < 0 ? strerror(errno) : "short");
			return -GPX__STATUS__EINVAL;
		}
		got += n;
	}
	return 0;
}

static bool
inside(uint64_t off, uint64_t len, uint64_t size)
{
	return off <= size && len <= size - off;
}

int
xfer_build(struct conn *c, const Gpx__Transfer *t, int segfd, struct job **out, char *err, size_t errlen)
{
	struct rhandle *sh, *dh;
	struct gpx_wire_seg *segs;
	uint32_t n;
	uint64_t total = 0;
	int r;

	if ((r = resolve(c, t->src_region, "source", &sh, err, errlen)) < 0 ||
	    (r = resolve(c, t->dst_region, "destination", &dh, err, errlen)) < 0)
		return r;
	if (dh->read_only || dh->r->read_only) {
		snprintf(err, errlen, "destination region %#llx is read-only", (unsigned long long)t->dst_region);
		log_audit(c, "%s", err);
		return -GPX__STATUS__EACCES;
	}
	if ((segfd >= 0) != (t->seg_count > 0) || (segfd >= 0 && t->n_segments > 0)) {
		snprintf(err, errlen, "segments must come either inline or as seg_count plus one memfd");
		return -GPX__STATUS__EPROTO;
	}
	n = segfd >= 0 ? t->seg_count : (uint32_t)t->n_segments;
	if (n == 0 || n > cfg->max_segs) {
		snprintf(err, errlen, "%u segments (1..%u allowed)", n, cfg->max_segs);
		return -GPX__STATUS__EINVAL;
	}
	/* The claimed count is checked against the memfd before anything is allocated for it. */
	if (segfd >= 0 && (r = segs_fd_ok(segfd, n, err, errlen)) < 0)
		return r;
	if ((segs = malloc((size_t)n * sizeof(*segs))) == NULL) {
		snprintf(err, errlen, "out of memory for %u segments", n);
		return -GPX__STATUS__ENOMEM;
	}
	if (segfd >= 0) {
		if ((r = read_segs(segfd, n, segs, err, errlen)) < 0) {
			free(segs);
			return r;
		}
	} else
		for (uint32_t i = 0; i < n; i++) {
			segs[i].src_offset = t->segments[i]->src_offset;
			segs[i].dst_offset = t->segments[i]->dst_offset;
			segs[i].length = t->segments[i]->length;
		}
	for (uint32_t i = 0; i < n; i++) {
		const struct gpx_wire_seg *g = &segs[i];
		if (!inside(g->src_offset, g->length, sh->r->length) ||
		    !inside(g->dst_offset, g->length, dh->r->length) || total + g->length < total) {
			snprintf(err, errlen, "segment %u (%llu+%llu -> %llu+%llu) leaves its region "
			    "(source %llu bytes, destination %llu bytes)", i,
			    (unsigned long long)g->src_offset, (unsigned long long)g->length,
			    (unsigned long long)g->dst_offset, (unsigned long long)g->length,
			    (unsigned long long)sh->r->length, (unsigned long long)dh->r->length);
			log_audit(c, "%s", err);
			free(segs);
			return -GPX__STATUS__ERANGE;
		}
		total += g->length;
	}

	struct job *j = calloc(1, sizeof(*j));
	if (j == NULL) {
		free(segs);
		snprintf(err, errlen, "out of memory");
		return -GPX__STATUS__ENOMEM;
	}
	if (!region_use(sh->r)) {
		free(segs);
		free(j);
		snprintf(err, errlen, "source region was withdrawn by its owner");
		return -GPX__STATUS__EREVOKED;
	}
	if (!region_use(dh->r)) {
		region_unuse(sh->r);
		free(segs);
		free(j);
		snprintf(err, errlen, "destination region was withdrawn by its owner");
		return -GPX__STATUS__EREVOKED;
	}
	region_ref(sh->r);
	region_ref(dh->r);
	j->src = sh->r;
	j->dst = dh->r;
	j->segs = segs;
	j->nseg = n;
	j->total = total;
	j->tag = t->tag;
	j->flags = t->flags;
	j->client = c->id;
	j->path = engine_path_for(sh->r, dh->r);
	j->t_submit = now_s();
	*out = j;
	return 0;
}
