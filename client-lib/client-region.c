/*
 * libgpxclient's memory: host buffers (gpx_host_alloc, a sealed memfd), registering them and
 * deregistering (gpx_register_host, gpx_deregister), sharing regions under a name
 * (gpx_export, gpx_export_remote, gpx_unexport, gpx_import), and the messages client-lib/cuda.c
 * sends for GPU memory: a Register it filled in, and the VMM pieces under a range.
 */
#include "config.h"

#include <fcntl.h>
#include <stdbool.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>

#include "client-lib/client-private.h"

API int
gpx_host_alloc(size_t len, int *fd, void **ptr)
{
	int f = memfd_create("gpx-host", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	if (f < 0)
		return -GPX_ESYS;
	if (ftruncate(f, len) < 0 || fcntl(f, F_ADD_SEALS, F_SEAL_SHRINK) < 0) {
		close(f);
		return -GPX_ESYS;
	}
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
	if (p == MAP_FAILED) {
		close(f);
		return -GPX_ENOMEM;
	}
	*fd = f;
	*ptr = p;
	return 0;
}

API void
gpx_host_free(int fd, void *ptr, size_t len)
{
	if (ptr != NULL)
		munmap(ptr, len);
	if (fd >= 0)
		close(fd);
}

/* The answer to a Register: the region id, and what it is for client_last_region. */
static int
registered(gpx_conn *c, const Gpx__Reply *rep, gpx_region *out)
{
	if (rep->body_case != GPX__REPLY__BODY_REGISTERED)
		return client_error(c, GPX_EPROTO, "unexpected reply to Register");
	*out = rep->registered->region;
	c->last_kind = rep->registered->kind;
	c->last_ro = rep->registered->read_only;
	return 0;
}

/* Sends a filled-in Register (with its fd, if any) and returns the region id. */
int
client_register(gpx_conn *c, Gpx__Register *reg, int fd, gpx_region *out)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Reply *rep;
	int r;

	m.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	m.register_ = reg;
	if ((r = client_rpc(c, &m, fd >= 0 ? &fd : NULL, fd >= 0, &rep, NULL, NULL)) < 0)
		return r;
	return registered(c, rep, out);
}

const char *
client_last_region(const gpx_conn *c, int *read_only)
{
	*read_only = c->last_ro;
	switch (c->last_kind) {
	case GPX__MEM_KIND__MEM_HOST: return "host";
	case GPX__MEM_KIND__MEM_CUDA_IPC: return "cuda-ipc";
	case GPX__MEM_KIND__MEM_CUDA_VMM: return "cuda-vmm";
	case GPX__MEM_KIND__MEM_CUDA_POOL: return "cuda-pool";
	case GPX__MEM_KIND__MEM_REMOTE: return "remote";
	}
	return "unknown";
}

API int
gpx_register_host(gpx_conn *c, int fd, uint64_t offset, uint64_t length, unsigned flags, gpx_region *out)
{
	Gpx__Register reg = GPX__REGISTER__INIT;

	reg.kind = GPX__MEM_KIND__MEM_HOST;
	reg.offset = offset;
	reg.length = length;
	reg.access = (flags & GPX_REG_READONLY) ? GPX__ACCESS__ACCESS_RO : GPX__ACCESS__ACCESS_RW;
	return client_register(c, &reg, fd, out);
}

API int
gpx_deregister(gpx_conn *c, gpx_region region)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Deregister d = GPX__DEREGISTER__INIT;

	d.region = region;
	m.body_case = GPX__CLIENT_MSG__BODY_DEREGISTER;
	m.deregister = &d;
	return client_rpc(c, &m, NULL, 0, NULL, NULL, NULL);
}

/* ---- sharing ---- */

/* Sends an Export; with remote, it may be imported from the listed peers (none: all). */
static int
export(gpx_conn *c, gpx_region region, const char *name, const struct gpx_export_opts *o,
    bool remote, char **peers, size_t npeers)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Export e = GPX__EXPORT__INIT;

	e.region = region;
	e.name = (char *)name;
	if (o != NULL) {
		e.rule = (Gpx__ExportRule)o->rule;
		e.gid = o->gid;
		e.read_only = o->read_only != 0;
		e.notify = o->notify != 0;
		e.notify_tag = o->notify_tag;
	}
	e.remote = remote;
	e.peers = peers;
	e.n_peers = npeers;
	m.body_case = GPX__CLIENT_MSG__BODY_EXPORT;
	m.export = &e;
	return client_rpc(c, &m, NULL, 0, NULL, NULL, NULL);
}

API int
gpx_export(gpx_conn *c, gpx_region region, const char *name, const struct gpx_export_opts *o)
{
	return export(c, region, name, o, false, NULL, 0);
}

/* Between nodes (gpx.h): the Export message with remote set and the allowed peers listed. */
API int
gpx_export_remote(gpx_conn *c, gpx_region region, const char *name, const struct gpx_export_opts *o,
    const char *peers)
{
	char *list[256], buf[4096];
	size_t n = 0;

	if (peers != NULL) {
		if (strlen(peers) >= sizeof(buf))
			return client_error(c, GPX_EINVAL, "peer list too long");
		strcpy(buf, peers);
		for (char *sv, *s = strtok_r(buf, ", ", &sv); s != NULL; s = strtok_r(NULL, ", ", &sv)) {
			if (n == sizeof(list) / sizeof(list[0]))
				return client_error(c, GPX_EINVAL, "at most 256 peers");
			list[n++] = s;
		}
	}
	return export(c, region, name, o, true, list, n);
}

API int
gpx_unexport(gpx_conn *c, const char *name)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Unexport u = GPX__UNEXPORT__INIT;

	u.name = (char *)name;
	m.body_case = GPX__CLIENT_MSG__BODY_UNEXPORT;
	m.unexport = &u;
	return client_rpc(c, &m, NULL, 0, NULL, NULL, NULL);
}

API int
gpx_import(gpx_conn *c, const char *name, gpx_region *out, uint64_t *length)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Import i = GPX__IMPORT__INIT;
	Gpx__Reply *rep;
	int r;

	i.name = (char *)name;
	m.body_case = GPX__CLIENT_MSG__BODY_IMPORT;
	m.import = &i;
	if ((r = client_rpc(c, &m, NULL, 0, &rep, NULL, NULL)) < 0)
		return r;
	if (rep->body_case != GPX__REPLY__BODY_REGISTERED)
		return client_error(c, GPX_EPROTO, "unexpected reply to Import");
	*out = rep->registered->region;
	if (length != NULL)
		*length = rep->registered->length;
	c->last_kind = rep->registered->kind;
	c->last_ro = rep->registered->read_only;
	return 0;
}

/* ---- VMM pieces (client-lib/cuda.c finds and exports them) ---- */

int
client_register_pieces(gpx_conn *c, Gpx__Register *reg, const struct gpx_wire_piece *pieces, size_t n,
    gpx_region *out, uint32_t *missing, size_t *nmissing)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Reply *rep = NULL;
	void *p;
	uint64_t off;
	int r;

	*nmissing = 0;
	if (c->dead)
		return client_error(c, GPX_ECONN, "the connection to gpxd was lost");
	if (n == 0 || n > c->max_segs)
		return client_error(c, GPX_EINVAL, "too many pieces under one range");
	c->area.resv_n = 0;
	if ((r = client_area_take(c, n * sizeof(*pieces), &p, &off)) < 0)
		return r;
	memcpy(p, pieces, n * sizeof(*pieces));
	reg->piece_count = n;
	reg->area_offset = off;
	m.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	m.register_ = reg;
	r = client_rpc(c, &m, NULL, 0, &rep, NULL, NULL);
	if (r != -GPX_ECONN)
		client_area_sent(c);        /* the daemon counts every Register naming the area */
	if (r == -GPX_ENOENT && rep != NULL) {
		for (size_t i = 0; i < rep->n_missing && i < GPX_MISSING_MAX; i++) {
			if (rep->missing[i] >= n)
				return client_error(c, GPX_EPROTO, "gpxd named a piece that was not listed");
			missing[(*nmissing)++] = rep->missing[i];
		}
		return r;
	}
	if (r < 0)
		return r;
	return registered(c, rep, out);
}

int
client_send_pieces(gpx_conn *c, const uint8_t uuid[16], uint64_t res, uint64_t res_size,
    const struct gpx_wire_piece *pieces, const int *fds, size_t n)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Pieces ps = GPX__PIECES__INIT;
	Gpx__Piece one[GPX_PIECES_MAX], *ptrs[GPX_PIECES_MAX];

	if (n == 0 || n > GPX_PIECES_MAX)
		return client_error(c, GPX_EINVAL, "1..GPX_PIECES_MAX pieces a message");
	for (size_t i = 0; i < n; i++) {
		gpx__piece__init(&one[i]);
		one[i].id = pieces[i].id;
		one[i].offset = pieces[i].offset;
		one[i].size = pieces[i].size;
		ptrs[i] = &one[i];
	}
	ps.device_uuid.data = (uint8_t *)uuid;
	ps.device_uuid.len = 16;
	ps.reservation = res;
	ps.reservation_size = res_size;
	ps.n_pieces = n;
	ps.pieces = ptrs;
	m.body_case = GPX__CLIENT_MSG__BODY_PIECES;
	m.pieces = &ps;
	return client_rpc(c, &m, fds, (int)n, NULL, NULL, NULL);
}
