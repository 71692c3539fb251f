/*
 * libgpxclient: the client side of the gpx protocol (proto/gpx.proto).
 *
 * Requests that expect an answer (Hello, Register, Export, Import, Cancel, Query, Admin) are
 * sent with a sequence number and the call blocks until the Reply with that number arrives.
 * Transfers are fire-and-forget: the daemon answers them in the completion ring it shares with
 * us, or, if it refuses one before it runs, with a Reply carrying the transfer's tag, which is
 * turned into a completion here.  Either way each transfer yields exactly one completion.
 *
 * Completions that were read but not yet handed to the caller (refusals, or records set aside
 * by gpx_wait_tag) wait in a small backlog that gpx_poll empties first.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sched.h>
#include <time.h>

#include "client-lib/client.h"
#include "client-lib/gpx.h"
#include "proto/gpx.pb-c.h"
#include "proto/ring.h"
#include "proto/wire.h"

#define API __attribute__((visibility("default")))
#define SYNC_TAG_BIT (1ULL << 63)    /* tags of gpx_copy_sync; reserved for the library */

_Static_assert(sizeof(struct gpx_seg) == sizeof(struct gpx_wire_seg), "segment layout");

/*
 * The segment area: a memfd shared read-only with the daemon, used as a ring of segment lists.
 * Positions are monotonic byte counts (offset = position % len).  Each Transfer that uses it
 * is remembered with the position where its list ends; the daemon counts the Transfers it has
 * copied out in the completion ring header (segs_consumed), which frees their space in order.
 */
struct area_use {
	uint64_t index;            /* the n-th Transfer that used the area */
	uint64_t end;              /* position after its list */
};

struct area {
	int fd;
	unsigned char *p;
	size_t len;
	uint64_t head, tail;       /* positions: next write, oldest byte still in use */
	uint64_t used;             /* Transfers sent that used the area */
	struct area_use *q;        /* FIFO of those not yet known to be consumed */
	size_t qhead, qn, qcap;
	/* gpx_segs_reserve: room at position resv for resv_n segments, until the next transfer */
	uint64_t resv;
	size_t resv_n;
};

#define AREA_MIN (2u << 20)

static void area_free(struct area *);

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
#define AREA_INLINE_MAX 64         /* up to this many segments travel inside the message */

struct gpx_conn {
	int sock;
	int efd;
	bool own_efd;
	int epfd;
	bool dead;
	struct gpx_ring_hdr *ring;
	size_t ring_len;
	uint32_t entries;
	uint64_t tail;
	uint64_t sq_tail;              /* submissions published (our copy) */
	uint64_t client_id;
	uint32_t seq;
	uint32_t max_inline;
	uint32_t max_segs;
	unsigned outstanding;
	uint64_t sync_tags;
	struct gpx_completion *back;   /* backlog, FIFO */
	size_t nback, capback;
	struct wire_arena *arena;
	struct area area;
	/* What the daemon said of the last region registered or imported (client_last_region). */
	int last_kind;
	bool last_ro;
	/* Told each refused transfer's reason (client_refusal_hook). */
	void (*refusal_fn)(void *arg, uint64_t tag, const char *reason);
	void *refusal_arg;
	uint8_t buf[GPX_MSG_MAX];
	char last_error[256];
};

static const char *errnames[] = {
	[GPX_OK] = "success",
	[GPX_EPROTO] = "protocol error",
	[GPX_EVERSION] = "protocol version not supported by the daemon",
	[GPX_EINVAL] = "invalid argument",
	[GPX_ENOENT] = "no such region, export or transfer",
	[GPX_EACCES] = "permission denied",
	[GPX_ERANGE] = "segment out of the region's bounds",
	[GPX_EBUSY] = "busy: too many outstanding transfers, or connections waiting",
	[GPX_EQUOTA] = "per-user limit reached",
	[GPX_EBADFD] = "file descriptor of the wrong kind",
	[GPX_ENOMEM] = "out of memory",
	[GPX_ECANCELED] = "transfer cancelled",
	[GPX_EREVOKED] = "region withdrawn by its owner",
	[GPX_EEXIST] = "export name already in use",
	[GPX_ENOTSUP] = "memory kind or path not supported here",
	[GPX_EIO] = "copy failed",
	[GPX_ESHUTDOWN] = "daemon shutting down",
	[GPX_EDRAINING] = "client is being drained",
	[GPX_EPERM] = "administrative request not permitted",
};

API const char *
gpx_strerror(int err)
{
	int e = err < 0 ? -err : err;

	if (e < (int)(sizeof(errnames) / sizeof(errnames[0])) && errnames[e] != NULL)
		return errnames[e];
	switch (e) {
	case GPX_ECONN: return "cannot reach gpxd, or the connection was lost";
	case GPX_ETIMEDOUT: return "timed out";
	case GPX_ESYS: return "system call failed";
	}
	return "unknown error";
}

API const char *
gpx_last_error(const gpx_conn *c)
{
	return c->last_error;
}

API uint64_t
gpx_client_id(const gpx_conn *c)
{
	return c->client_id;
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

static int
set_err(gpx_conn *c, int code, const char *msg)
{
	snprintf(c->last_error, sizeof(c->last_error), "%s", msg ? msg : gpx_strerror(code));
	return -code;
}

static void
backlog_push(gpx_conn *c, const struct gpx_completion *e)
{
	if (c->nback == c->capback) {
		size_t n = c->capback ? c->capback * 2 : 16;
		struct gpx_completion *b = realloc(c->back, n * sizeof(*b));
		if (b == NULL)
			return;    /* cannot happen in practice; the completion is lost, not the process */
		c->back = b;
		c->capback = n;
	}
	c->back[c->nback++] = *e;
}

static int
send_msg(gpx_conn *c, Gpx__ClientMsg *m, const int *fds, int nfds)
{
	if (c->dead)
		return set_err(c, GPX_ECONN, "the connection to gpxd was lost");
	int r = wire_send_msg(c->sock, &m->base, fds, nfds);
	if (r == -EMSGSIZE)
		return set_err(c, GPX_EINVAL, "request too large for one message");
	if (r < 0) {
		c->dead = true;
		return set_err(c, GPX_ECONN, "the connection to gpxd was lost");
	}
	return 0;
}

/*
 * Receives one message.  Replies that answer a transfer (they carry a tag and no request is
 * waiting for them) become completions.  Returns the Reply (valid until the next receive),
 * NULL with *err = 0 if nothing was there (non-blocking), or NULL with a negative *err.
 */
static Gpx__Reply *
recv_one(gpx_conn *c, bool block, int *fds, int *nfds, int *err)
{
	int lfds[GPX_MAX_FDS], lnfds;
	ssize_t n = wire_recv(c->sock, c->buf, fds ? fds : lfds, nfds ? nfds : &lnfds, GPX_MAX_FDS,
	    block ? 0 : MSG_DONTWAIT);

	*err = 0;
	if (n == -EAGAIN)
		return NULL;
	if (n <= 0) {
		c->dead = true;
		*err = set_err(c, GPX_ECONN, n == 0 ? "gpxd closed the connection" : "receive failed");
		return NULL;
	}
	if (fds == NULL)
		wire_close_fds(lfds, lnfds);
	wire_arena_reset(c->arena);
	Gpx__DaemonMsg *m = gpx__daemon_msg__unpack(&c->arena->pa, n, c->buf);
	if (m == NULL || m->body_case != GPX__DAEMON_MSG__BODY_REPLY) {
		if (fds != NULL)
			wire_close_fds(fds, *nfds);
		*err = set_err(c, GPX_EPROTO, "undecodable message from gpxd");
		return NULL;
	}
	return m->reply;
}

/* A Reply that is no request's answer: a refused transfer, or a warning about a bad message. */
static void
async_reply(gpx_conn *c, const Gpx__Reply *r)
{
	if (r->status != 0 && r->message && r->message[0])
		snprintf(c->last_error, sizeof(c->last_error), "%s", r->message);
	if (r->seq == 0 && r->tag == 0)
		return;
	struct gpx_completion e = { .tag = r->tag, .bytes = 0, .status = -(int)r->status };
	if (c->outstanding > 0)
		c->outstanding--;
	if (c->refusal_fn != NULL && e.status < 0)
		c->refusal_fn(c->refusal_arg, e.tag, r->message && r->message[0] ? r->message : NULL);
	backlog_push(c, &e);
}

#define RPC_SPIN_S 50e-6
#define SQ_SEQ 0xffffffffu     /* the daemon's seq for refusals of queued submissions */

/* Sequence numbers of requests: never 0 (unsolicited) nor SQ_SEQ. */
static uint32_t
next_seq(gpx_conn *c)
{
	do
		c->seq++;
	while (c->seq == 0 || c->seq == SQ_SEQ);
	return c->seq;
}

static double
now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/*
 * A connection gpxd would not admit (a limit on connections) is closed at once after a Reply
 * with seq 0 that says why, so the Hello fails to go out, or the first receive reports the
 * reset (the kernel says that before the Reply waiting behind it).  If that Reply is there,
 * *err becomes its status.
 */
static void
refusal(gpx_conn *c, int *err)
{
	for (int i = 0; i < 2; i++) {
		int e;
		Gpx__Reply *r = recv_one(c, false, NULL, NULL, &e);
		if (r != NULL && r->seq == 0 && r->status != 0) {
			*err = set_err(c, r->status, r->message && r->message[0] ? r->message : NULL);
			return;
		}
		if (r != NULL || e == 0)
			return;
	}
}

/* Sends m and waits for its Reply; fds of the reply (if any) land in rfds. */
static int
rpc(gpx_conn *c, Gpx__ClientMsg *m, const int *fds, int nfds, Gpx__Reply **out, int *rfds, int *rnfds)
{
	bool hello = m->body_case == GPX__CLIENT_MSG__BODY_HELLO;
	int err;

	m->seq = next_seq(c);
	if ((err = send_msg(c, m, fds, nfds)) < 0) {
		if (hello)
			refusal(c, &err);
		return err;
	}
	double spin_until = now_s() + RPC_SPIN_S;
	for (;;) {
		int lfds[GPX_MAX_FDS], lnfds = 0;
		/* Most answers come within microseconds: poll for them briefly before sleeping. */
		bool block = now_s() >= spin_until;
		Gpx__Reply *r = recv_one(c, block, lfds, &lnfds, &err);
		if (r == NULL && err == 0 && !block)
			continue;
		if (r == NULL) {
			if (hello && err == -GPX_ECONN)
				refusal(c, &err);
			return err;
		}
		if (r->seq != m->seq) {
			wire_close_fds(lfds, lnfds);
			/* gpxd refuses a connection it will not admit with seq 0 before any answer */
			if (hello && r->seq == 0 && r->tag == 0 && r->status != 0)
				return set_err(c, r->status, r->message && r->message[0] ? r->message : NULL);
			async_reply(c, r);
			continue;
		}
		if (rfds != NULL) {
			memcpy(rfds, lfds, lnfds * sizeof(int));
			*rnfds = lnfds;
		} else
			wire_close_fds(lfds, lnfds);
		if (out != NULL)
			*out = r;      /* a refusal's too: Register's list of missing pieces */
		if (r->status != 0) {
			if (rfds != NULL)
				wire_close_fds(rfds, *rnfds);
			return set_err(c, r->status, r->message && r->message[0] ? r->message : NULL);
		}
		c->last_error[0] = '\0';
		return 0;
	}
}

static int
connect_sock(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd;

	if (strlen(path) >= sizeof(sa.sun_path))
		return -GPX_EINVAL;
	strcpy(sa.sun_path, path);
	if ((fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)) < 0)
		return -GPX_ESYS;
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		close(fd);
		return -GPX_ECONN;
	}
	return fd;
}

static int
map_ring(gpx_conn *c, int fd, uint32_t entries)
{
	struct stat st;
	size_t len = gpx_ring_size(entries);

	if (entries == 0 || (entries & (entries - 1)) || fstat(fd, &st) < 0 || (size_t)st.st_size < len)
		return -GPX_EPROTO;
	c->ring = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (c->ring == MAP_FAILED) {
		c->ring = NULL;
		return -GPX_ENOMEM;
	}
	if (c->ring->magic != GPX_RING_MAGIC || c->ring->entries != entries ||
	    c->ring->entry_size != sizeof(struct gpx_cqe)) {
		munmap(c->ring, len);
		c->ring = NULL;
		return -GPX_EPROTO;
	}
	c->ring_len = len;
	c->entries = entries;
	c->tail = __atomic_load_n(&c->ring->tail, __ATOMIC_ACQUIRE);
	c->sq_tail = __atomic_load_n(&c->ring->sq_tail, __ATOMIC_ACQUIRE);
	return 0;
}

API int
gpx_connect_opts(const struct gpx_connect_opts *o, gpx_conn **out)
{
	const char *path = o->socket;
	gpx_conn *c;
	int r;

	*out = NULL;
	if (path == NULL && (path = getenv("GPX_SOCKET")) == NULL)
		path = GPX_DEFAULT_SOCKET;
	if ((c = calloc(1, sizeof(*c))) == NULL)
		return -GPX_ENOMEM;
	c->efd = c->epfd = -1;
	c->area.fd = -1;
	if ((c->arena = wire_arena_new(GPX_ARENA_SIZE)) == NULL) {
		free(c);
		return -GPX_ENOMEM;
	}
	if ((c->sock = connect_sock(path)) < 0) {
		r = c->sock;
		c->sock = -1;
		gpx_close(c);
		return r;
	}
	if (!o->no_ring) {
		if (o->eventfd >= 0)
			c->efd = fcntl(o->eventfd, F_DUPFD_CLOEXEC, 0);
		else {
			c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
			c->own_efd = true;
		}
		if (c->efd < 0) {
			gpx_close(c);
			return -GPX_ESYS;
		}
	}

	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Hello h = GPX__HELLO__INIT;
	Gpx__Reply *rep;
	int rfds[GPX_MAX_FDS], rnfds = 0;
	h.version = GPX_PROTO_VERSION;
	h.name = (char *)(o->name ? o->name : "");
	h.no_ring = o->no_ring != 0;
	m.body_case = GPX__CLIENT_MSG__BODY_HELLO;
	m.hello = &h;
	if ((r = rpc(c, &m, c->efd >= 0 ? &c->efd : NULL, c->efd >= 0, &rep, rfds, &rnfds)) < 0) {
		gpx_close(c);
		return r;
	}
	if (rep->body_case != GPX__REPLY__BODY_WELCOME || rnfds != (o->no_ring ? 0 : 1)) {
		wire_close_fds(rfds, rnfds);
		gpx_close(c);
		return -GPX_EPROTO;
	}
	c->client_id = rep->welcome->client_id;
	c->max_inline = rep->welcome->max_inline_segs;
	c->max_segs = rep->welcome->max_segs;
	if (!o->no_ring) {
		r = map_ring(c, rfds[0], rep->welcome->ring_entries);
		close(rfds[0]);
		if (r < 0) {
			gpx_close(c);
			return r;
		}
	}
	struct epoll_event ev = { .events = EPOLLIN };
	if ((c->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0 ||
	    epoll_ctl(c->epfd, EPOLL_CTL_ADD, c->sock, &ev) < 0 ||
	    (c->efd >= 0 && epoll_ctl(c->epfd, EPOLL_CTL_ADD, c->efd, &ev) < 0)) {
		gpx_close(c);
		return -GPX_ESYS;
	}
	*out = c;
	return 0;
}

API int
gpx_connect(const char *socket, const char *name, gpx_conn **out)
{
	struct gpx_connect_opts o = { .socket = socket, .name = name, .eventfd = -1 };

	return gpx_connect_opts(&o, out);
}

API void
gpx_close(gpx_conn *c)
{
	if (c == NULL)
		return;
	if (c->sock >= 0)
		close(c->sock);
	if (c->efd >= 0)
		close(c->efd);
	if (c->epfd >= 0)
		close(c->epfd);
	if (c->ring != NULL)
		munmap(c->ring, c->ring_len);
	area_free(&c->area);
	free(c->back);
	free(c->arena);
	free(c);
}

/* ---- memory ---- */

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
		return set_err(c, GPX_EPROTO, "unexpected reply to Register");
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
	if ((r = rpc(c, &m, fd >= 0 ? &fd : NULL, fd >= 0, &rep, NULL, NULL)) < 0)
		return r;
	return registered(c, rep, out);
}

int
client_error(gpx_conn *c, int code, const char *msg)
{
	return set_err(c, code, msg);
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

void
client_refusal_hook(gpx_conn *c, void (*fn)(void *arg, uint64_t tag, const char *reason), void *arg)
{
	c->refusal_fn = fn;
	c->refusal_arg = arg;
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
	return rpc(c, &m, NULL, 0, NULL, NULL, NULL);
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
	return rpc(c, &m, NULL, 0, NULL, NULL, NULL);
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
			return set_err(c, GPX_EINVAL, "peer list too long");
		strcpy(buf, peers);
		for (char *sv, *s = strtok_r(buf, ", ", &sv); s != NULL; s = strtok_r(NULL, ", ", &sv)) {
			if (n == sizeof(list) / sizeof(list[0]))
				return set_err(c, GPX_EINVAL, "at most 256 peers");
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
	return rpc(c, &m, NULL, 0, NULL, NULL, NULL);
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
	if ((r = rpc(c, &m, NULL, 0, &rep, NULL, NULL)) < 0)
		return r;
	if (rep->body_case != GPX__REPLY__BODY_REGISTERED)
		return set_err(c, GPX_EPROTO, "unexpected reply to Import");
	*out = rep->registered->region;
	if (length != NULL)
		*length = rep->registered->length;
	c->last_kind = rep->registered->kind;
	c->last_ro = rep->registered->read_only;
	return 0;
}

/* ---- transfers ---- */

static void
area_free(struct area *a)
{
	if (a->p != NULL)
		munmap(a->p, a->len);
	if (a->fd >= 0)
		close(a->fd);
	free(a->q);
	memset(a, 0, sizeof(*a));
	a->fd = -1;
}

/* Makes an area of at least `need` bytes and hands it to the daemon, replacing the old one. */
static int
area_grow(gpx_conn *c, size_t need)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__SegArea sa = GPX__SEG_AREA__INIT;
	struct area a = { .fd = -1 };
	size_t len = AREA_MIN;
	int r;

	while (len < 2 * need && len < GPX_AREA_MAX)
		len *= 2;
	if (need > len)
		return set_err(c, GPX_EINVAL, "segment list larger than the largest segment area");
	a.fd = memfd_create("gpx-segments", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (a.fd < 0 || ftruncate(a.fd, len) < 0 ||
	    fcntl(a.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0 ||
	    (a.p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, a.fd, 0)) == MAP_FAILED) {
		a.p = NULL;
		area_free(&a);
		return set_err(c, GPX_ESYS, "cannot create the segment area");
	}
	a.len = len;
	sa.length = len;
	m.body_case = GPX__CLIENT_MSG__BODY_SEG_AREA;
	m.seg_area = &sa;
	/* Its reply also says the daemon is done with every list in the old area. */
	if ((r = rpc(c, &m, &a.fd, 1, NULL, NULL, NULL)) < 0) {
		area_free(&a);
		return r;
	}
	area_free(&c->area);
	c->area = a;
	return 0;
}

/* Frees the space of the lists the daemon has copied out. */
static void
area_reclaim(gpx_conn *c)
{
	struct area *a = &c->area;
	uint64_t done = __atomic_load_n(&c->ring->segs_consumed, __ATOMIC_ACQUIRE);

	while (a->qn > 0 && a->q[a->qhead].index < done) {
		a->tail = a->q[a->qhead].end;
		a->qhead = (a->qhead + 1) % a->qcap;
		a->qn--;
	}
	if (a->qn == 0)
		a->tail = a->head;
}

/* Finds room for need bytes (a list never wraps): its position.  Waits briefly if the area is full. */
static int
area_room(gpx_conn *c, size_t need, uint64_t *at)
{
	struct area *a = &c->area;
	int r;

	if (a->p == NULL || need > a->len / 2) {
		if ((r = area_grow(c, need)) < 0)
			return r;
	}
	for (int spins = 0;; spins++) {
		area_reclaim(c);
		uint64_t pos = a->head;
		if (pos % a->len + need > a->len)
			pos += a->len - pos % a->len;
		if (pos + need - a->tail <= a->len) {
			*at = pos;
			return 0;
		}
		/* The daemon copies lists out as it reads the socket: it is never long. */
		if (c->dead || spins > 1000000)
			return set_err(c, GPX_EBUSY, "the segment area stays full");
		sched_yield();
	}
}

/* Whether segs points into the segment area (a reserved list, or a stale pointer to one). */
static bool
in_area(const gpx_conn *c, const struct gpx_seg *segs)
{
	uintptr_t p = (uintptr_t)segs, base = (uintptr_t)c->area.p;

	return c->area.p != NULL && p >= base && p < base + c->area.len;
}

/* Takes need bytes of room in the area for a list: where to write it, its offset in *off. */
static int
area_take(gpx_conn *c, size_t need, void **p, uint64_t *off)
{
	struct area *a = &c->area;
	uint64_t pos;
	int r;

	if ((r = area_room(c, need, &pos)) < 0)
		return r;
	*p = a->p + pos % a->len;
	*off = pos % a->len;
	a->head = pos + need;
	return 0;
}

/*
 * Puts segs into the area, *off is where they start: a list written in place in the room of
 * gpx_segs_reserve stays where it is, anything else is copied in.
 */
static int
area_put(gpx_conn *c, const struct gpx_seg *segs, size_t n, uint64_t *off)
{
	struct area *a = &c->area;
	size_t need = n * sizeof(*segs);
	void *p;
	int r;

	if (in_area(c, segs)) {
		if (a->resv_n == 0 || (const unsigned char *)segs != a->p + a->resv % a->len || n > a->resv_n)
			return set_err(c, GPX_EINVAL, "a list in the segment area outside the room reserved for it");
		*off = a->resv % a->len;
		a->head = a->resv + need;
		return 0;
	}
	if ((r = area_take(c, need, &p, off)) < 0)
		return r;
	memcpy(p, segs, need);
	return 0;
}

/* Records the list just sent, to be freed once the daemon reports it consumed. */
static void
area_sent(gpx_conn *c)
{
	struct area *a = &c->area;

	a->used++;
	if (a->qn == a->qcap) {
		size_t ncap = a->qcap ? a->qcap * 2 : 64;
		struct area_use *q = malloc(ncap * sizeof(*q));
		if (q == NULL)
			return;      /* then its space is reclaimed with the next one's */
		for (size_t i = 0; i < a->qn; i++)
			q[i] = a->q[(a->qhead + i) % a->qcap];
		free(a->q);
		a->q = q;
		a->qhead = 0;
		a->qcap = ncap;
	}
	a->q[(a->qhead + a->qn) % a->qcap] = (struct area_use){ .index = a->used - 1, .end = a->head };
	a->qn++;
}

/*
 * A single-segment transfer through the submission queue: no message at all while the daemon
 * polls, an SqKick when it said it sleeps.  Returns 1 if the queue is full (then the transfer
 * goes as a message).
 */
static int
sq_put(gpx_conn *c, gpx_region src, gpx_region dst, const struct gpx_seg *s, uint64_t tag)
{
	struct gpx_ring_hdr *h = c->ring;

	if (c->sq_tail - __atomic_load_n(&h->sq_head, __ATOMIC_ACQUIRE) >= c->entries)
		return 1;
	struct gpx_sqe *e = gpx_sq_slot(h, c->entries, c->sq_tail);
	*e = (struct gpx_sqe){ .tag = tag, .src_region = src, .dst_region = dst, .src_offset = s->src_offset,
		.dst_offset = s->dst_offset, .length = s->length };
	c->sq_tail++;
	__atomic_store_n(&h->sq_tail, c->sq_tail, __ATOMIC_RELEASE);
	__atomic_thread_fence(__ATOMIC_SEQ_CST);   /* pairs with the daemon's before it sleeps */
	if (__atomic_load_n(&h->sq_wakeup, __ATOMIC_RELAXED)) {
		Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
		Gpx__SqKick k = GPX__SQ_KICK__INIT;
		m.seq = next_seq(c);
		m.body_case = GPX__CLIENT_MSG__BODY_SQ_KICK;
		m.sq_kick = &k;
		int r = send_msg(c, &m, NULL, 0);
		if (r < 0)
			return r;
	}
	return 0;
}

/* Whether c may take a list of n segments now: what submit and gpx_segs_reserve both ask. */
static int
segs_usable(gpx_conn *c, size_t n)
{
	if (c->ring == NULL)
		return set_err(c, GPX_EINVAL, "this connection has no completion queue");
	if (c->dead)
		return set_err(c, GPX_ECONN, "the connection to gpxd was lost");
	if (n == 0 || n > c->max_segs)
		return set_err(c, GPX_EINVAL, "segment count out of range");
	return 0;
}

/* Sends a Transfer (a list it names in the segment area was put there): credit and area use. */
static int
transfer_send(gpx_conn *c, Gpx__Transfer *t)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	int r;

	c->area.resv_n = 0;        /* any transfer ends a reservation */
	m.seq = next_seq(c);
	m.body_case = GPX__CLIENT_MSG__BODY_TRANSFER;
	m.transfer = t;
	if ((r = send_msg(c, &m, NULL, 0)) == 0) {
		c->outstanding++;
		if (t->seg_count > 0)
			area_sent(c);
	}
	return r;
}

static int
submit(gpx_conn *c, gpx_region src, gpx_region dst, const struct gpx_seg *segs, size_t n, uint64_t tag)
{
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	Gpx__Segment one = GPX__SEGMENT__INIT, *onep = &one;
	Gpx__Segment *arr = NULL, **ptrs = NULL;
	int r;

	if ((r = segs_usable(c, n)) < 0)
		return r;
	if (c->outstanding >= c->entries)
		return set_err(c, GPX_EBUSY, "no credit left: collect completions first");
	if (n == 1 && (r = sq_put(c, src, dst, segs, tag)) <= 0) {
		c->area.resv_n = 0;
		if (r == 0)
			c->outstanding++;
		return r;
	}
	t.tag = tag;
	t.src_region = src;
	t.dst_region = dst;
	if (n == 1) {
		one.src_offset = segs[0].src_offset;
		one.dst_offset = segs[0].dst_offset;
		one.length = segs[0].length;
		t.n_segments = 1;
		t.segments = &onep;
	} else if (n <= AREA_INLINE_MAX && !in_area(c, segs)) {
		/* (a reserved list goes as it lies in the area; the room is given up with it) */
		arr = malloc(n * sizeof(*arr));
		ptrs = malloc(n * sizeof(*ptrs));
		if (arr == NULL || ptrs == NULL) {
			free(arr);
			free(ptrs);
			return set_err(c, GPX_ENOMEM, NULL);
		}
		for (size_t i = 0; i < n; i++) {
			gpx__segment__init(&arr[i]);
			arr[i].src_offset = segs[i].src_offset;
			arr[i].dst_offset = segs[i].dst_offset;
			arr[i].length = segs[i].length;
			ptrs[i] = &arr[i];
		}
		t.n_segments = n;
		t.segments = ptrs;
	} else {
		/* Longer lists are written into the segment area the daemon copies them out of. */
		uint64_t off;
		if ((r = area_put(c, segs, n, &off)) < 0) {
			c->area.resv_n = 0;
			return r;
		}
		t.seg_count = n;
		t.area_offset = off;
	}
	r = transfer_send(c, &t);
	free(arr);
	free(ptrs);
	return r;
}

API int
gpx_copy(gpx_conn *c, gpx_region src, uint64_t src_off, gpx_region dst, uint64_t dst_off,
    uint64_t len, uint64_t tag)
{
	struct gpx_seg s = { src_off, dst_off, len };

	return submit(c, src, dst, &s, 1, tag);
}

API int
gpx_copyv(gpx_conn *c, gpx_region src, gpx_region dst, const struct gpx_seg *segs, size_t n, uint64_t tag)
{
	return submit(c, src, dst, segs, n, tag);
}

API int
gpx_copy_pages(gpx_conn *c, gpx_region src, uint64_t src_off, gpx_region dst, uint64_t dst_off,
    uint64_t page_size, const uint32_t *src_pages, const uint32_t *dst_pages, size_t n, uint64_t tag)
{
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	struct gpx_wire_page *w;
	uint64_t off;
	int r;

	if ((r = segs_usable(c, n)) < 0)
		return r;
	if (page_size == 0 || src_pages == NULL || dst_pages == NULL)
		return set_err(c, GPX_EINVAL, "a page transfer needs a page size and both page lists");
	if (c->outstanding >= c->entries)
		return set_err(c, GPX_EBUSY, "no credit left: collect completions first");
	c->area.resv_n = 0;        /* any transfer ends a reservation */
	if ((r = area_take(c, n * sizeof(*w), (void **)&w, &off)) < 0)
		return r;
	/* The pairs, side by side: the one pass over the lists this transfer makes here. */
	for (size_t i = 0; i < n; i++)
		w[i] = (struct gpx_wire_page){ src_pages[i], dst_pages[i] };
	t.tag = tag;
	t.src_region = src;
	t.dst_region = dst;
	t.seg_count = n;
	t.area_offset = off;
	t.page_size = page_size;
	t.src_offset = src_off;
	t.dst_offset = dst_off;
	return transfer_send(c, &t);
}

_Static_assert(sizeof(struct gpx_pair) == sizeof(struct gpx_wire_pair), "pair layout");

/*
 * A batch: the pairs, then the segment or page list, in one piece of the segment area, and
 * one Transfer naming both.  recs is the list's record size, fill writes it in place.
 */
static int
batch_send(gpx_conn *c, const struct gpx_pair *pairs, size_t npairs, size_t nrecs, size_t recs,
    uint64_t page_size, void (*fill)(void *at, const void *a, const void *b, size_t n),
    const void *a, const void *b, uint64_t tag)
{
	Gpx__Transfer t = GPX__TRANSFER__INIT;
	unsigned char *p;
	uint64_t off;
	int r;

	if ((r = segs_usable(c, nrecs)) < 0)
		return r;
	if (pairs == NULL || npairs == 0 || npairs > GPX_PAIRS_MAX)
		return set_err(c, GPX_EINVAL, "a batch takes 1..GPX_PAIRS_MAX pairs");
	if (c->outstanding >= c->entries)
		return set_err(c, GPX_EBUSY, "no credit left: collect completions first");
	c->area.resv_n = 0;        /* any transfer ends a reservation */
	if ((r = area_take(c, npairs * sizeof(*pairs) + nrecs * recs, (void **)&p, &off)) < 0)
		return r;
	memcpy(p, pairs, npairs * sizeof(*pairs));
	fill(p + npairs * sizeof(*pairs), a, b, nrecs);
	t.tag = tag;
	t.pair_count = npairs;
	t.pair_offset = off;
	t.seg_count = nrecs;
	t.area_offset = off + npairs * sizeof(*pairs);
	t.page_size = page_size;
	return transfer_send(c, &t);
}

static void
fill_segs(void *at, const void *segs, const void *unused, size_t n)
{
	(void)unused;
	memcpy(at, segs, n * sizeof(struct gpx_seg));
}

/* The two page lists side by side, as gpx_copy_pages writes them. */
static void
fill_pages(void *at, const void *src, const void *dst, size_t n)
{
	struct gpx_wire_page *w = at;
	const uint32_t *s = src, *d = dst;

	for (size_t i = 0; i < n; i++)
		w[i] = (struct gpx_wire_page){ s[i], d[i] };
}

API int
gpx_copy_batch(gpx_conn *c, const struct gpx_pair *pairs, size_t npairs, const struct gpx_seg *segs,
    size_t nsegs, uint64_t tag)
{
	if (segs == NULL)
		return set_err(c, GPX_EINVAL, "a batch of segments needs its segment list");
	return batch_send(c, pairs, npairs, nsegs, sizeof(*segs), 0, fill_segs, segs, NULL, tag);
}

API int
gpx_copy_pages_batch(gpx_conn *c, const struct gpx_pair *pairs, size_t npairs, uint64_t page_size,
    const uint32_t *src_pages, const uint32_t *dst_pages, size_t npages, uint64_t tag)
{
	if (page_size == 0 || src_pages == NULL || dst_pages == NULL)
		return set_err(c, GPX_EINVAL, "a page transfer needs a page size and both page lists");
	return batch_send(c, pairs, npairs, npages, sizeof(struct gpx_wire_page), page_size, fill_pages,
	    src_pages, dst_pages, tag);
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
		return set_err(c, GPX_ECONN, "the connection to gpxd was lost");
	if (n == 0 || n > c->max_segs)
		return set_err(c, GPX_EINVAL, "too many pieces under one range");
	c->area.resv_n = 0;
	if ((r = area_take(c, n * sizeof(*pieces), &p, &off)) < 0)
		return r;
	memcpy(p, pieces, n * sizeof(*pieces));
	reg->piece_count = n;
	reg->area_offset = off;
	m.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	m.register_ = reg;
	r = rpc(c, &m, NULL, 0, &rep, NULL, NULL);
	if (r != -GPX_ECONN)
		area_sent(c);        /* the daemon counts every Register naming the area */
	if (r == -GPX_ENOENT && rep != NULL) {
		for (size_t i = 0; i < rep->n_missing && i < GPX_MISSING_MAX; i++) {
			if (rep->missing[i] >= n)
				return set_err(c, GPX_EPROTO, "gpxd named a piece that was not listed");
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
		return set_err(c, GPX_EINVAL, "1..GPX_PIECES_MAX pieces a message");
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
	return rpc(c, &m, fds, (int)n, NULL, NULL, NULL);
}

API int
gpx_segs_reserve(gpx_conn *c, size_t n, struct gpx_seg **out)
{
	uint64_t pos;
	int r;

	*out = NULL;
	if ((r = segs_usable(c, n)) < 0)
		return r;
	c->area.resv_n = 0;
	if ((r = area_room(c, n * sizeof(**out), &pos)) < 0)
		return r;
	c->area.resv = pos;
	c->area.resv_n = n;
	*out = (struct gpx_seg *)(c->area.p + pos % c->area.len);
	return 0;
}

API int
gpx_cancel(gpx_conn *c, uint64_t tag)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Cancel x = GPX__CANCEL__INIT;

	x.tag = tag;
	m.body_case = GPX__CLIENT_MSG__BODY_CANCEL;
	m.cancel = &x;
	return rpc(c, &m, NULL, 0, NULL, NULL, NULL);
}

/* ---- completions ---- */

static void
drain_socket(gpx_conn *c)
{
	int err;
	Gpx__Reply *r;

	while ((r = recv_one(c, false, NULL, NULL, &err)) != NULL)
		async_reply(c, r);
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
 * Whether a wait should look at the ring again instead of sleeping: for the first
 * CLIENT_WAIT_SPIN_S of a wait that may block.  Most copies of a few KiB complete within
 * that, and being woken from epoll costs more than the copy (on virtual machines 100 us and
 * more).
 */
static bool
wait_spin(double *until, int timeout_ms)
{
	if (timeout_ms == 0)
		return false;
	double t = now_s();
	if (*until == 0)
		*until = t + CLIENT_WAIT_SPIN_S;
	return t < *until;
}

/* Completions already in the ring, without reading the socket: the spin's cheap look. */
bool
client_ring_ready(const gpx_conn *c)
{
	return c->ring != NULL && __atomic_load_n(&c->ring->head, __ATOMIC_ACQUIRE) != c->tail;
}

API int
gpx_wait(gpx_conn *c, struct gpx_completion *out, int max, int timeout_ms)
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
		if (wait_spin(&spin, timeout_ms)) {
			while (!client_ring_ready(c) && wait_spin(&spin, timeout_ms))
				cpu_relax();
			continue;
		}
		int r = sleep_once(c, timeout_ms);
		if (r < 0)
			return r;
	}
}

API int
gpx_wait_tag(gpx_conn *c, uint64_t tag, struct gpx_completion *out, int timeout_ms)
{
	struct gpx_completion tmp[64];
	double spin = 0;

	for (;;) {
		for (size_t i = 0; i < c->nback; i++)
			if (c->back[i].tag == tag && !(c->back[i].flags & GPX_COMP_NOTIFY)) {
				*out = c->back[i];
				memmove(&c->back[i], &c->back[i + 1], (c->nback - i - 1) * sizeof(*out));
				c->nback--;
				return 0;
			}
		clear_doorbell(c);
		drain_socket(c);
		int k = c->ring ? take_ring(c, tmp, 64) : 0;
		if (k < 0)
			return k;
		for (int i = 0; i < k; i++)
			backlog_push(c, &tmp[i]);
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
		if (wait_spin(&spin, timeout_ms)) {
			while (!client_ring_ready(c) && wait_spin(&spin, timeout_ms))
				cpu_relax();
			continue;
		}
		int r = sleep_once(c, timeout_ms);
		if (r < 0)
			return r;
	}
}

API int
gpx_copy_sync(gpx_conn *c, gpx_region src, uint64_t src_off, gpx_region dst, uint64_t dst_off, uint64_t len)
{
	uint64_t tag = SYNC_TAG_BIT | ++c->sync_tags;
	struct gpx_completion done;
	int r;

	if ((r = gpx_copy(c, src, src_off, dst, dst_off, len, tag)) < 0)
		return r;
	if ((r = gpx_wait_tag(c, tag, &done, -1)) < 0)
		return r;
	if (done.status < 0)
		set_err(c, -done.status, c->last_error[0] ? c->last_error : NULL);
	return done.status;
}

/* ---- introspection and administration ---- */

API int
gpx_query(gpx_conn *c, enum gpx_query what, void **buf, size_t *len)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Query q = GPX__QUERY__INIT;
	Gpx__Reply *rep;
	int rfds[GPX_MAX_FDS], rnfds = 0, r;

	q.what = (Gpx__QueryWhat)what;
	m.body_case = GPX__CLIENT_MSG__BODY_QUERY;
	m.query = &q;
	if ((r = rpc(c, &m, NULL, 0, &rep, rfds, &rnfds)) < 0)
		return r;
	if (rep->query_in_fd) {
		struct stat st;
		if (rnfds != 1 || fstat(rfds[0], &st) < 0 || st.st_size <= 0 || st.st_size > (256 << 20)) {
			wire_close_fds(rfds, rnfds);
			return set_err(c, GPX_EPROTO, "bad query reply");
		}
		*len = st.st_size;
		*buf = malloc(*len);
		ssize_t got = *buf ? pread(rfds[0], *buf, *len, 0) : -1;
		close(rfds[0]);
		if (got != (ssize_t)*len) {
			free(*buf);
			return set_err(c, GPX_ESYS, "reading the query reply");
		}
		return 0;
	}
	wire_close_fds(rfds, rnfds);
	if (rep->body_case != GPX__REPLY__BODY_QUERY)
		return set_err(c, GPX_EPROTO, "unexpected reply to Query");
	*len = gpx__query_reply__get_packed_size(rep->query);
	if ((*buf = malloc(*len ? *len : 1)) == NULL)
		return -GPX_ENOMEM;
	gpx__query_reply__pack(rep->query, *buf);
	return 0;
}

API int
gpx_admin(gpx_conn *c, enum gpx_admin op, uint64_t arg, const char *text, char *reply, size_t replylen)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Admin a = GPX__ADMIN__INIT;
	Gpx__Reply *rep;
	int r;

	a.op = (Gpx__Admin__Op)op;
	a.arg = arg;
	a.text = (char *)(text ? text : "");
	m.body_case = GPX__CLIENT_MSG__BODY_ADMIN;
	m.admin = &a;
	if ((r = rpc(c, &m, NULL, 0, &rep, NULL, NULL)) < 0)
		return r;
	if (reply != NULL && replylen > 0)
		snprintf(reply, replylen, "%s", rep->message ? rep->message : "");
	return 0;
}
