/*
 * libgpxclient: hand memory to gpxd once, then ask it to copy between buffers of this and
 * other processes, and learn of each copy's end through a completion queue and an eventfd.
 *
 * Error contract: every function that returns int returns 0 (or a count, where it says so) on
 * success and a negative GPX_E* code on failure; gpx_strerror() names it, and
 * gpx_last_error() gives the daemon's own explanation of the last refusal on a connection.
 * The library never exits, never prints and never raises signals (it sends with MSG_NOSIGNAL).
 *
 * Threads: a gpx_conn is not thread-safe; use one per thread or serialise calls to it.
 * Different connections are independent.
 */
#ifndef GPX_GPX_H
#define GPX_GPX_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GPX_API_VERSION 1

/* Error codes (returned negated).  The values equal gpx.Status on the wire. */
enum {
	GPX_OK = 0,
	GPX_EPROTO = 1,     /* malformed or unexpected message */
	GPX_EVERSION = 2,   /* protocol version not spoken by the daemon */
	GPX_EINVAL = 3,     /* an argument is out of range */
	GPX_ENOENT = 4,     /* no such region, export or transfer */
	GPX_EACCES = 5,     /* not allowed (ownership, export rule, trust domain) */
	GPX_ERANGE = 6,     /* a segment leaves its region */
	GPX_EBUSY = 7,      /* out of credits: too many outstanding transfers; or memory still in use;
	                     * or, from gpx_connect, the daemon at a limit on connections */
	GPX_EQUOTA = 8,     /* a per-uid limit is reached */
	GPX_EBADFD = 9,     /* a passed fd is not what it should be */
	GPX_ENOMEM = 10,    /* out of memory (here or in the daemon) */
	GPX_ECANCELED = 11, /* the transfer was cancelled */
	GPX_EREVOKED = 12,  /* the region's owner withdrew it */
	GPX_EEXIST = 13,    /* an export of that name exists */
	GPX_ENOTSUP = 14,   /* memory kind or path not available */
	GPX_EIO = 15,       /* the copy failed */
	GPX_ESHUTDOWN = 16, /* the daemon is stopping */
	GPX_EDRAINING = 17, /* an operator drains this client */
	GPX_EPERM = 18,     /* administrative request from a non-administrator */
	GPX_ECONN = 100,    /* cannot reach the daemon, or the connection was lost */
	GPX_ETIMEDOUT = 101,/* the wait timed out */
	GPX_ESYS = 102,     /* a system call failed; errno tells which */
};

typedef struct gpx_conn gpx_conn;
typedef uint64_t gpx_region;

/* One finished transfer (or, with GPX_COMP_NOTIFY, a peer's copy into an exported region). */
struct gpx_completion {
	uint64_t tag;
	uint64_t bytes;        /* bytes moved */
	int status;            /* 0 or a negative GPX_E* code */
	uint32_t flags;        /* GPX_COMP_* */
};
#define GPX_COMP_NOTIFY 0x1u

struct gpx_seg {
	uint64_t src_offset;
	uint64_t dst_offset;
	uint64_t length;
};

struct gpx_connect_opts {
	const char *socket;    /* NULL: $GPX_SOCKET, else /run/gpx/gpxd.sock */
	const char *name;      /* shown by gpxctl */
	int eventfd;           /* -1: the library makes one; else yours (it is duplicated): one
	                        * write per completion record, so an EFD_SEMAPHORE eventfd
	                        * counts them; gpx_wait then reads one count per wake */
	int no_ring;           /* query-only connection (gpxctl): no transfers */
};

/* ---- connections ---- */
int gpx_connect(const char *socket, const char *name, gpx_conn **out);
int gpx_connect_opts(const struct gpx_connect_opts *opts, gpx_conn **out);
void gpx_close(gpx_conn *c);
uint64_t gpx_client_id(const gpx_conn *c);
/*
 * The daemon's explanation of the last refused request on c (never NULL); with c NULL, why this
 * thread's last gpx_connect failed, naming the socket (the system's reason, or gpxd's refusal).
 */
const char *gpx_last_error(const gpx_conn *c);
const char *gpx_strerror(int err);

/* ---- memory ---- */
/* Makes a memfd of len bytes sealed against shrinking and maps it: memory gpxd accepts. */
int gpx_host_alloc(size_t len, int *fd, void **ptr);
void gpx_host_free(int fd, void *ptr, size_t len);

#define GPX_REG_READONLY 0x1u   /* the region may only be a source */
/* Registers [offset, offset+length) of a memfd (sealed with F_SEAL_SHRINK).  The fd is not taken. */
int gpx_register_host(gpx_conn *c, int fd, uint64_t offset, uint64_t length, unsigned flags,
    gpx_region *out);
int gpx_deregister(gpx_conn *c, gpx_region r);

/*
 * Registers [ptr, ptr+length) of CUDA device memory (the caller's current context need not be
 * set).  The library finds the allocation that holds ptr and picks the kind from it:
 * cuMemCreate memory exportable as a POSIX fd becomes a `cuda-vmm` region: the range may span
 * any number of physical allocations mapped back to back in one address reservation (PyTorch's
 * expandable segments), each exported as a POSIX fd the first time the daemon is shown it and
 * mapped by the daemon at its place in its own mirror of the reservation; memory of a stream-ordered pool created exportable as POSIX fds
 * (cudaMallocFromPoolAsync) becomes a `cuda-pool` region (the pool's fd and the allocation's
 * export data; the device's default pool, used by plain cudaMallocAsync, is refused);
 * cudaMalloc/cuMemAlloc memory becomes a `cuda-ipc` region (a legacy IPC handle of the
 * allocation base plus the offset), which the daemon accepts only on a node configured as one
 * trust domain.  Anything else fails with GPX_ENOTSUP and a reason in
 * gpx_last_error(); nothing is ever silently copied through host memory.  Without a CUDA
 * driver it fails with GPX_ENOTSUP.
 */
int gpx_register_cuda(gpx_conn *c, const void *ptr, uint64_t length, unsigned flags, gpx_region *out);

/* ---- sharing ---- */
enum gpx_export_rule { GPX_EXPORT_UID = 0, GPX_EXPORT_GID = 1, GPX_EXPORT_ANY = 2 };
struct gpx_export_opts {
	enum gpx_export_rule rule;  /* who may import: same uid (default), a gid, anyone */
	uint32_t gid;
	int read_only;              /* importers may only read */
	int notify;                 /* post a GPX_COMP_NOTIFY record here when a peer's copy in ends */
	uint64_t notify_tag;
};
int gpx_export(gpx_conn *c, gpx_region r, const char *name, const struct gpx_export_opts *opts);
int gpx_unexport(gpx_conn *c, const char *name);
int gpx_import(gpx_conn *c, const char *name, gpx_region *out, uint64_t *length);
/*
 * Between nodes: like gpx_export, and peer daemons may import the region too, as
 * "NODE:name" where NODE is this daemon's node name.  peers is a comma-separated list of the
 * peer nodes allowed ("a,b"), or NULL for any peer that authenticated with the nodes' shared
 * key.  (The uid/gid rule of opts applies to clients of this daemon only.)  An import of
 * "NODE:name" on another node yields an ordinary region of kind remote: gpx_copy to or from it
 * moves the bytes over the fabric, completes as any copy does, and notifies the owner if it
 * asked.  Either side may be host or GPU memory (gpxd.conf(5) says how GPU memory moves).
 * One side only: a copy between two remote regions (of one node or two) fails with
 * GPX_ENOTSUP and gpx_last_error says so; copy through a region of this node instead.
 * The importer may name the node by the address its daemon listens on instead,
 * "@HOST:PORT/name" or "@[IPV6]:PORT/name" (gpxd.conf(5): dial_on_demand).
 */
int gpx_export_remote(gpx_conn *c, gpx_region r, const char *name, const struct gpx_export_opts *opts,
    const char *peers);

/*
 * ---- transfers: asynchronous; each ends in exactly one completion ----
 * Transfers are independent: they may run and complete in any order.  A transfer the daemon
 * refuses before it runs (bounds, rights, credit) completes with the error too; such a
 * completion comes over the socket, which gpx_fd() includes, and rings no eventfd.  Tags with
 * the top bit set are used by gpx_copy_sync.  gpx_copy returns before the daemon has read the
 * request; its arguments need not outlive the call.
 */
int gpx_copy(gpx_conn *c, gpx_region src, uint64_t src_off, gpx_region dst, uint64_t dst_off,
    uint64_t len, uint64_t tag);
int gpx_copyv(gpx_conn *c, gpx_region src, gpx_region dst, const struct gpx_seg *segs, size_t n,
    uint64_t tag);
/*
 * Room for n segments in the connection's segment area, the shared memory that long lists go
 * to the daemon in.  A list written there and given to gpx_copyv as it lies (segs = *out, at
 * most n segments) is not copied again: for tens of thousands of pages, one pass over the list
 * fewer.  The room is the caller's until the next transfer submitted on c or the next
 * gpx_segs_reserve, which takes its place; leave the list alone once it is submitted.
 * (GPXCLIENT_0.3)
 */
int gpx_segs_reserve(gpx_conn *c, size_t n, struct gpx_seg **out);
/*
 * Pages: n copies of page_size bytes, page src_pages[i] of src (at src_off + src_pages[i] *
 * page_size) to page dst_pages[i] of dst; KV-cache blocks by their block numbers.  The list
 * takes 8 bytes a page instead of a segment's 24, and where a GPU's copy kernel runs it, gpxd
 * hands the kernel its checked copy as it is.  The whole list is checked before any page moves.
 * (GPXCLIENT_0.4)
 */
int gpx_copy_pages(gpx_conn *c, gpx_region src, uint64_t src_off, gpx_region dst, uint64_t dst_off,
    uint64_t page_size, const uint32_t *src_pages, const uint32_t *dst_pages, size_t n, uint64_t tag);
/*
 * Pages whose numbers lie in GPU memory, as a program's block table does: at table_off of the
 * registered (or imported) GPU region table, n source page numbers, then n destination page
 * numbers (uint32_t each; table_off a multiple of 4).  Nothing of the list crosses the host:
 * the page kernel of the GPU that runs the copy reads the numbers in place and checks each
 * one as it reads it, so a page out of its side's region is not copied and the transfer
 * completes with GPX_ERANGE (the others are copied).  Finish the GPU work that writes the
 * table before submitting, and leave it alone until the completion, as with the pages
 * themselves.  Needs a copy the page kernel runs (both sides GPU memory, on one GPU or two
 * with peer access); else GPX_ENOTSUP.  (GPXCLIENT_0.6)
 */
int gpx_copy_pages_table(gpx_conn *c, gpx_region src, uint64_t src_off, gpx_region dst, uint64_t dst_off,
    uint64_t page_size, gpx_region table, uint64_t table_off, size_t n, uint64_t tag);
/*
 * Batches: many (source region, destination region) pairs in one request.  A KV-cache
 * handoff moves the same block numbers out of every layer's K and V tensors into another
 * process's; a weight push moves every tensor of a model.  The whole batch is checked before
 * any byte moves (every pair's regions, rights and bounds: one bad pair refuses it all), runs
 * in as few kernel launches and copy-engine submissions as its paths allow, and ends in one
 * completion whose bytes count every pair.  pairs[i].src_offset and dst_offset are added to
 * the offsets of pair i's segments, or are the bases its pages are numbered from.
 * gpx_copy_batch: pair i copies segs[seg_first, seg_first + seg_count) (pairs may share
 * segments).  gpx_copy_pages_batch: every pair copies the one page list, as gpx_copy_pages
 * does for one pair (seg_first and seg_count are ignored).  (GPXCLIENT_0.5)
 */
struct gpx_pair {
	gpx_region src;
	gpx_region dst;
	uint64_t src_offset;
	uint64_t dst_offset;
	uint32_t seg_first;
	uint32_t seg_count;
};
#define GPX_PAIRS_MAX 16384     /* pairs in one batch */
int gpx_copy_batch(gpx_conn *c, const struct gpx_pair *pairs, size_t npairs, const struct gpx_seg *segs,
    size_t nsegs, uint64_t tag);
int gpx_copy_pages_batch(gpx_conn *c, const struct gpx_pair *pairs, size_t npairs, uint64_t page_size,
    const uint32_t *src_pages, const uint32_t *dst_pages, size_t npages, uint64_t tag);
/*
 * gpx_copy_pages_batch with the page numbers in GPU memory, as gpx_copy_pages_table takes
 * them: every pair copies the table's pages.  Every pair must be one that the same GPU's page
 * kernel runs (GPX_ENOTSUP otherwise).  (GPXCLIENT_0.6)
 */
int gpx_copy_pages_batch_table(gpx_conn *c, const struct gpx_pair *pairs, size_t npairs, uint64_t page_size,
    gpx_region table, uint64_t table_off, size_t npages, uint64_t tag);
int gpx_cancel(gpx_conn *c, uint64_t tag);
/* Blocking: submits and waits for this transfer's own completion; returns its status. */
int gpx_copy_sync(gpx_conn *c, gpx_region src, uint64_t src_off, gpx_region dst, uint64_t dst_off,
    uint64_t len);

/* ---- completions ---- */
/* Non-blocking: up to max completions into out; returns how many (0 if none). */
int gpx_poll(gpx_conn *c, struct gpx_completion *out, int max);
/* Waits up to timeout_ms (-1: forever) for at least one; returns how many. */
int gpx_wait(gpx_conn *c, struct gpx_completion *out, int max, int timeout_ms);
/* Waits for the completion of one tag; others stay queued for gpx_poll. */
int gpx_wait_tag(gpx_conn *c, uint64_t tag, struct gpx_completion *out, int timeout_ms);
/* An fd for the caller's own poll/epoll: readable when gpx_poll may return something. */
int gpx_fd(const gpx_conn *c);
/* Transfers submitted and not yet returned by gpx_poll/gpx_wait. */
unsigned gpx_outstanding(const gpx_conn *c);
/* Notifications the daemon dropped because this connection's queue was full. */
uint64_t gpx_dropped(const gpx_conn *c);

/* ---- introspection, for gpxctl: the raw packed QueryReply of gpx.proto ---- */
enum gpx_query {
	GPX_Q_STATUS = 0, GPX_Q_CLIENTS, GPX_Q_REGIONS, GPX_Q_EXPORTS, GPX_Q_TRANSFERS,
	GPX_Q_STATS, GPX_Q_TOPO, GPX_Q_PEERS, GPX_Q_CLUSTER,
};
/* *buf is malloc'ed; the caller frees it and unpacks it with the generated gpx.pb-c code. */
int gpx_query(gpx_conn *c, enum gpx_query what, void **buf, size_t *len);
enum gpx_admin { GPX_ADMIN_RELOAD = 0, GPX_ADMIN_DRAIN = 1, GPX_ADMIN_LOG_LEVEL = 2 };
/* Administrative request; reply (may be NULL) receives the daemon's message, e.g. the log level. */
int gpx_admin(gpx_conn *c, enum gpx_admin op, uint64_t arg, const char *text, char *reply,
    size_t replylen);

#ifdef __cplusplus
}
#endif
#endif
