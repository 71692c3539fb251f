/*
 * gpxd internals: the types and functions the daemon's subsystems share.  Each block below
 * belongs to one file, whose name is the functions' prefix (conn_* in conn.c, engine_* in
 * engine.c, ...).  The daemon is built as libgpxd.a plus a tiny main.c, so the tests link the
 * same code.
 *
 * Threads: one libevent loop thread owns connections, region tables, exports and users.
 * Copy workers and blocking-task threads touch only jobs, regions (through atomic reference
 * counts) and completion queues (struct cq, with its own lock); GPU workers also read the
 * configuration, through a snapshot they hold (conf_refresh).  Nothing else is shared.
 */
#ifndef GPXD_H
#define GPXD_H

#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <pthread.h>
#include <sys/queue.h>
#include <sys/types.h>

#ifndef TAILQ_FOREACH_SAFE
#define TAILQ_FOREACH_SAFE(var, head, field, tvar) \
	for ((var) = TAILQ_FIRST(head); (var) && ((tvar) = TAILQ_NEXT(var, field), 1); (var) = (tvar))
#endif

#include "proto/gpx.pb-c.h"
#include "proto/ring.h"
#include "proto/wire.h"
#include "daemon/cluster/cluster.h"

struct event_base;
struct conn;
struct region;
struct job;
struct xfer_check;

#define GPXD_VERSION PACKAGE_VERSION

/* The body of a spin-wait loop: lets the sibling hardware thread run, saves power. */
static inline void
cpu_pause(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

/* ---- log.c: stderr or the journal, with subsystem tokens for debug filtering ---- */
enum { LOG_L_ERR, LOG_L_WARN, LOG_L_INFO, LOG_L_DEBUG };
void log_init(int level, const char *debug_subsys, bool to_journal);
int log_set_level(const char *spec);
const char *log_get_level(void);
bool log_level_debug(void);
void log_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_warnx(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_debug(const char *sub, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/*
 * Lines a client or a uid can cause at will (refusals, connections coming and going) are
 * rate-limited per source, as journald and the kernel do: each client and each uid has a
 * share of the log per window (struct logrl), and what a uid's window held back is reported
 * in one line when the window ends; root's and the admin group's are not limited.  Loop
 * thread only.
 */
struct logrl {
	double start;                /* when the current window began */
	uint32_t lines;              /* lines let through in it */
	uint32_t held;               /* lines held back in it (counted on the uid) */
};
/*
 * Who a line is about: a client of a uid, or (client 0, mine NULL) a uid alone, with their
 * shares of the log.  Built by the callers (log_audit and log_client in conn.c, log_uid in
 * user.c): the log knows no connection or user.
 */
struct logwho {
	uint64_t client;
	uid_t uid;
	pid_t pid;
	const char *name;
	bool operator;               /* root or the admin group: not limited */
	struct logrl *mine;          /* the client's share, or NULL */
	struct logrl *uid_share;     /* its uid's */
};
void log_vrefused(const struct logwho *, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));
void log_vwho(const struct logwho *, int level, const char *fmt, va_list ap) __attribute__((format(printf, 3, 0)));
/* Ends a uid's window when it is due (or when told), with a line for what it held back. */
void log_roll(struct logrl *uid_share, uid_t uid, bool force);
/* A line of a source that is neither a client nor a uid (an unauthenticated peer): its own share. */
void log_other(struct logrl *, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void fatal(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
void fatalx(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

/* ---- conf.c: gpxd.conf (ini), defaults, validation ---- */
struct conf {
	char *socket_path;
	unsigned socket_mode;
	char *socket_group;
	char *admin_group;
	int workers;                 /* host copy threads */
	int blocking_threads;        /* threads for registrations and handle imports */
	uint64_t chunk_size;
	uint32_t ring_entries;       /* completion ring per connection (= credits) */
	uint32_t max_segs;           /* segments in one vectored transfer */
	bool trust_legacy_ipc;       /* node is one trust domain: accept cudaIpcMemHandle */
	bool cuda;                   /* try to load the CUDA driver */
	bool sm_copy;                /* SM copy kernel for vectored GPU transfers */
	int sm_copy_blocks;          /* bounded share of the SMs for that kernel */
	/* per-uid limits */
	uint32_t max_conns_per_uid;
	uint32_t max_regions_per_uid;
	uint64_t max_region_bytes_per_uid;
	uint32_t max_exports_per_uid;
	uint32_t max_inflight_per_uid;
	/* budgets: bytes of gpxd's memory that clients' transfers may hold (user.c) */
	uint64_t budget_request;
	uint64_t budget_connection;
	uint64_t budget_uid;
	uint64_t budget_total;
	/* daemon-wide limits on connections (conn.c, levent.c) */
	uint32_t hello_max;          /* connections not yet past Hello */
	uint32_t reserved_fds;       /* descriptors held back for root and the admin group */
#define RESERVED_FDS_MAX 1024
	double idle_timeout_s;       /* a connection that sends nothing for this long is closed */
	uint32_t busy_poll_us;       /* the loop polls without sleeping this long after input */
	char *log_level;
	char *metrics_listen;        /* "127.0.0.1:9464", NULL = off */
	bool metrics_allow_remote;   /* serve metrics on a non-loopback address too */
	/* [fabric]: gpxd to gpxd (daemon/fabric/), on with listen, peers or dial_on_demand */
	char *fabric_node;           /* this node's name among peers (default: the hostname) */
	char *fabric_listen;         /* "ADDR:PORT" for peer connections, NULL = none */
	char *fabric_key_file;       /* key shared by the nodes (required when the fabric is on) */
	char *fabric_peers;          /* "HOST:PORT,HOST:PORT" to connect to */
	bool fabric_dial_on_demand;  /* an import "@HOST:PORT/name" may dial an address not in peers */
	char *fabric_transport;      /* auto | rdma | tcp */
	char *fabric_rdma_device;    /* NULL = chosen from the topology */
#define CONF_NICS 16
	char *fabric_nic_for_gpu[CONF_NICS];   /* nic_for_gpuN: GPU N's NIC; NULL = nearest (fabric/nic.c) */
	double fabric_timeout_s;     /* a request, a handshake or a silent peer fails after this */
	double fabric_retry_s;       /* between attempts to reach a configured peer */
	uint64_t fabric_chunk;       /* bytes per Write/Read on the wire */
	struct cluster_conf cluster; /* [cluster]: etcd (daemon/cluster/) */
	char *path;                  /* the file it came from, or NULL */
	atomic_uint refs;            /* holders of this snapshot (conf_hold) */
};
/* One key of gpxd.conf (conf.c's table conf_keys, ended by a NULL sec). */
enum conf_type {
	K_BOOL, K_INT, K_U32, K_POW2, K_U64, K_SECONDS, K_DOUBLE, K_MODE, K_NICS,
	K_STR,                       /* this and those below are char * */
	K_ABSPATH, K_LOGLEVEL, K_TRANSPORT, K_NODE, K_HOSTPORT, K_HOSTPORTS,
};
enum conf_when { CONF_LIVE, CONF_RESTART };
struct conf_key {
	const char *sec, *name;
	enum conf_type type;
	size_t off;                  /* of the field in struct conf */
	const char *def, *lo, *hi;   /* as the file writes them; NULL: none */
	enum conf_when when;         /* a reload applies it, or it waits for a restart */
};
extern const struct conf_key conf_keys[];
/*
 * A section parsed by another file's code, registered before the first conf_load: key stores
 * one key in the conf's fields of that code (-1 with why set for a bad value, with why empty
 * for an unknown key); check (may be NULL) checks the section after the whole file; same (may
 * be NULL) tells whether two confs agree on it, for the report of a reload (which names the
 * section as waiting for a restart when they differ, unless live); free releases its fields.
 */
struct conf_section {
	const char *name;
	int (*key)(struct conf *, const char *key, const char *value, char *why, size_t whylen);
	int (*check)(const struct conf *, char *why, size_t whylen);
	bool (*same)(const struct conf *, const struct conf *);
	void (*free)(struct conf *);
	bool live;
};
int conf_add_section(const struct conf_section *);
void conf_defaults(struct conf *);
int conf_load(struct conf *, const char *path, char *err, size_t errlen);
void conf_free(struct conf *);
int conf_parse_u64(const char *v, uint64_t *out);
/* "path" made absolute against the working directory; malloc'ed, NULL when out of memory. */
char *conf_abspath(const char *path);
/*
 * The running configuration.  The loop thread reads cfg directly: only it replaces it, between
 * events.  Any other thread reads a snapshot it holds: conf_hold, and conf_drop when done (a
 * worker keeps one and refreshes it with conf_refresh when conf_generation has moved on).
 */
extern struct conf *cfg;
struct conf *conf_new(void);         /* defaults, one reference */
const struct conf *conf_hold(void);
void conf_drop(const struct conf *);
const struct conf *conf_refresh(const struct conf *held);
/* Loop thread: n becomes cfg; the old snapshot is freed when its last holder drops it. */
void conf_publish(struct conf *n);
/*
 * Loop thread: the keys on which two configurations differ, as "sec.key sec.key" (live ones
 * in live, the others in restart); restart keys of n are set back to old's values, so that n
 * says what runs.  Keys in `fixed` (space-separated sec.key, given on the command line) are
 * kept from old too and listed in overridden.
 */
void conf_diff(const struct conf *old, struct conf *n, const char *fixed, char *live, char *restart,
    char *overridden, size_t len);

/* ---- sdn.c: everything that talks to systemd (stubbed when built without libsystemd) ---- */
int sdn_listen_fd(void);            /* the activated socket, or -1 */
bool sdn_journal_wanted(void);
bool sdn_supervised(void);          /* systemd started us: never detach */
void sdn_journal(int level, const char *msg);
void sdn_ready(const char *status);
void sdn_status(const char *status);
void sdn_reloading(void);
void sdn_stopping(void);
uint64_t sdn_watchdog_usec(void);   /* 0 = no watchdog */
void sdn_watchdog(void);

/* ---- defer.c: blocking work off the event loop, finished back on it ---- */
typedef void (*defer_fn)(void *arg);
int defer_init(struct event_base *, int threads);
void defer_shutdown(void);
/* Runs work(arg) on a task thread, then done(arg) on the loop thread. */
void defer_run(defer_fn work, defer_fn done, void *arg);

/* ---- user.c: per-uid accounting and limits ---- */
struct uqueue;
struct user {
	uid_t uid;
	uint32_t conns;              /* connections, counted from accept */
	uint32_t hello;              /* of them, not yet past Hello */
	uint32_t regions;
	uint64_t region_bytes;
	uint32_t exports;
	atomic_uint inflight;
	atomic_uint_fast64_t charged;   /* bytes of its budget its transfers and entries hold */
	struct logrl log;            /* its share of the log (log.c) */
	struct uqueue *uq;           /* its queues, one per path (engine.c, engine lock) */
	TAILQ_ENTRY(user) entry;
};
struct user *user_get(uid_t);
/* Who asks: a uid and its groups, as the kernel tells them. */
struct creds {
	uid_t uid;
	gid_t gid;
	const gid_t *groups;         /* supplementary */
	int ngroups;
};
bool creds_in_group(const struct creds *, gid_t);
/* A line about a uid alone, within its share of the log. */
void log_uid(struct user *, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Every second: ends the uids' windows that are due (final: all), reporting what they held. */
void user_log_tick(bool final);
void user_visit(void (*fn)(struct user *, void *), void *arg);
/* The uid with the most connections not yet past Hello, or NULL if none has any. */
struct user *user_most_hello(void);
/*
 * Budgets.  Every allocation a transfer makes in gpxd (its job, pairs, segment or page list,
 * the scratch of a batch) is charged before it is made against the request's budget, its
 * connection's, its uid's and the daemon's total; it is given back when the job is freed.  So
 * is every entry a client makes gpxd keep in its tables (a registered region with its handle,
 * an import, an export with its peer list, a request waiting for its reply, the growth of its
 * handle table): charged to the connection, the uid and the total before it is allocated,
 * given back when the entry or the client goes.  A connection's transfers are counted in its
 * completion queue (cq->charged, which copy workers give back to), its entries in the
 * connection itself (conn.entries, loop thread); its budget holds both.  Charging is the loop
 * thread's; giving back, any thread's for transfers, the loop thread's for entries.
 */
enum budget_scope { BUDGET_REQUEST, BUDGET_CONNECTION, BUDGET_UID, BUDGET_TOTAL, NBUDGETS };
struct cq;
struct charge {
	struct cq *cq;               /* the connection's transfers' count, or NULL */
	uint64_t *entries;           /* the connection's entries' count, or NULL */
	struct user *user;
	uint64_t bytes;              /* charged so far for the request */
	bool entry;                  /* charging entries (to *entries), not a transfer (to cq) */
	const char *what;            /* the request, for the refusal: "transfer" when NULL */
};
/*
 * Charges bytes more to the request; 0, or (the bytes not charged) a refusal naming the budget:
 * -GPX__STATUS__EBUSY when it would fit once transfers in flight end or entries go,
 * -GPX__STATUS__ENOMEM when it never fits.  What a refused request had charged is the caller's
 * to give back.
 */
int budget_charge(struct charge *, uint64_t bytes, char *err, size_t errlen);
void budget_release(struct cq *, struct user *, uint64_t bytes);
void budget_entry_release(uint64_t *entries, struct user *, uint64_t bytes);
const char *budget_name(enum budget_scope);
uint64_t budget_limit(enum budget_scope);
uint64_t budget_used(void);              /* the daemon's total */
uint64_t budget_entries(void);           /* of it, what entries hold */
uint64_t budget_refused(enum budget_scope, bool busy);

/* ---- mem-*.c: memory kinds behind one interface ---- */
#define DEV_HOST (-1)

struct mem_ops {
	const char *name;            /* "host", "cuda-ipc", "cuda-vmm", "cuda-pool" */
	/* Runs on a task thread: opens and maps what the request describes into r. */
	int (*open)(struct region *r, char *err, size_t errlen);
	/* Optional, loop thread: opens r from a cache without blocking; false if not cached. */
	bool (*try_open)(struct region *r);
	/* Undoes open; runs on whichever thread drops the last user. */
	void (*close)(struct region *r);
};

struct region {
	atomic_int refs;             /* lifetime of this struct: handles + jobs */
	atomic_int users;            /* lifetime of the mapping: owner handle + jobs */
	atomic_bool revoked;
	const struct mem_ops *ops;
	Gpx__MemKind kind;
	int dev;                     /* DEV_HOST or a gpu index */
	void *host;                  /* host-addressable pointer (host kind) */
	uint64_t dptr;               /* device address in the daemon's context (GPU kinds) */
	uint64_t length;
	bool read_only;
	uint64_t owner;              /* client id */
	uid_t uid;
	/* kind-private state */
	int fd;
	void *map;
	size_t map_len;
	uint64_t offset;
	void *priv;
	/* set by the request, used by open */
	uint8_t handle[64];
	uint8_t uuid[16];
	uint64_t alloc_size;
	uint64_t alloc_id;
	struct gpx_wire_piece *pieces;   /* cuda-vmm: the pieces under the range (vmm.c) */
	uint32_t npieces;
	/*
	 * Owner notification.  notify_cq, a ref on the owner's completion queue, is set by the
	 * first notifying export and kept until the mapping closes (copy workers read it without
	 * a lock); notify_on and notify_tag follow the notifying export, which can be withdrawn.
	 */
	struct cq *notify_cq;
	atomic_bool notify_on;
	_Atomic uint64_t notify_tag;
	char export_name[65];
	char gdr[112];               /* an export's GPU memory to peers: what fabric/stage.c found */
};

extern const struct mem_ops mem_host_ops;
extern const struct mem_ops mem_cuda_ipc_ops;
extern const struct mem_ops mem_cuda_vmm_ops;
extern const struct mem_ops mem_cuda_pool_ops;
const struct mem_ops *mem_ops_for(Gpx__MemKind);
bool mem_host_fd_ok(int fd, char *err, size_t errlen);
/* memmove for a host-path chunk; streaming stores when the job (job_bytes) exceeds the caches. */
void mem_host_copy(void *dst, const void *src, size_t n, uint64_t job_bytes);

/* ---- region.c: regions and the per-connection handle tables ---- */
struct rhandle {
	uint64_t id;                 /* epoch << 32 | serial: scoped to one connection */
	struct region *r;
	bool imported;
	bool read_only;              /* this handle may only be a source */
	struct rhandle *next;        /* hash chain */
	uint64_t charged;            /* bytes of its connection's budgets it holds (conn_charge) */
};
struct region *region_new(void);
void region_ref(struct region *);
void region_unref(struct region *);
bool region_use(struct region *);   /* takes a mapping user; false if revoked */
void region_unuse(struct region *);
void region_revoke(struct region *);

/* ---- engine.c: scheduling state kept in each client's completion queue ---- */
/* The most GPUs one gpxd drives: it bounds the path ids below and the 32-bit access masks; the
 * device tables themselves are sized at start by what the driver shows. */
#define GPX_MAX_GPUS 16
/* A path is where a copy executes: host memcpy workers, or the copy worker of one GPU. */
enum path_kind { PATH_HOST = 0, PATH_GPU0 = 1, PATH_FABRIC = PATH_GPU0 + GPX_MAX_GPUS, NPATHS };
struct equeue {
	TAILQ_ENTRY(equeue) rr;      /* in its uid's round-robin list while it has work */
	TAILQ_HEAD(, job) jobs;      /* jobs with bytes not yet handed to a worker */
	bool active;
};
/* A uid's part of a path: its connections with work there (round-robin between uids first). */
struct uqueue {
	TAILQ_ENTRY(uqueue) rr;      /* in its path's round-robin list while it has work */
	TAILQ_HEAD(, equeue) conns;
	bool active;
};

/* ---- cq.c: a connection's completion ring and eventfd doorbell ---- */
struct cq {
	atomic_int refs;
	pthread_mutex_t lock;
	struct gpx_ring_hdr *ring;
	size_t ring_len;
	int ring_fd;                 /* sent to the client once, then closed */
	int efd;                     /* the client's eventfd */
	uint32_t entries;
	uint32_t inflight;           /* accepted, not yet posted (under lock) */
	uint64_t head;               /* our copy of the ring's head: the shared one is never read back */
	bool broken;                 /* ring or eventfd misused: the loop disconnects the client */
	const char *broken_why;      /* how (a string constant) */
	uint64_t client;
	struct user *user;
	atomic_uint_fast64_t charged;   /* bytes of the connection's budget its transfers hold */
	/* per-client counters, read by gpxctl */
	atomic_uint_fast64_t bytes, transfers, errors;
	struct equeue eq[NPATHS];  /* engine lock */
};
struct cq *cq_new(uint32_t entries, int efd, uint64_t client, char *err, size_t errlen);
void cq_ref(struct cq *);
void cq_unref(struct cq *);
/* Reserves a credit for a new transfer; false if the ring could fill. */
int cq_reserve(struct cq *);
void cq_unreserve(struct cq *);
/* Posts the record of a reserved transfer and rings the doorbell. */
void cq_post(struct cq *, uint64_t tag, int status, uint64_t bytes);
/* Posts an unreserved notification if room is left, else counts it as dropped. */
void cq_notify(struct cq *, uint64_t tag, uint64_t region, uint64_t bytes);
void cq_set_broken_hook(void (*)(struct cq *));
void cq_signal_init(void);       /* installs the doorbell timeout's signal handler */

/* ---- engine.c: transfer jobs, per-path queues, copy workers, round-robin ---- */
#define SEG_BLOCK 64                 /* segments per entry of job.blocks */

/* A (source, destination) pair of a job: a batch's many, any other job's one. */
struct jpair {
	struct region *src, *dst;    /* mapping users held until the job ends */
	uint64_t src_base, dst_base; /* pages: where page 0 of each side lies */
	uint32_t seg_end;            /* the pair's segments (or pages) end before this one of the job */
	uint64_t bytes;              /* all it copies */
};

/* A batch whose pairs run on several paths: one job per path, one completion for all. */
struct jgroup {
	atomic_int left;             /* jobs not yet finished */
	atomic_bool failed, cancelled;
	atomic_uint_fast64_t done;
};

struct job {
	TAILQ_ENTRY(job) qe;         /* in its client's queue on its path */
	TAILQ_ENTRY(job) ae;         /* in the engine's list of live jobs */
	struct cq *cq;
	struct user *user;
	uint64_t client;
	uint64_t tag;
	uint32_t flags;
	struct region *src, *dst;    /* the first pair's (the only one's, but for batches) */
	struct jpair *pairs;         /* &one, or a batch's */
	uint32_t npairs;
	struct jpair one;
	struct jgroup *group;        /* a batch split over paths, else NULL */
	struct job *gnext;           /* the group's next job, while xfer_build hands them over */
	struct gpx_wire_seg *segs;   /* NULL for a page job: */
	struct gpx_wire_page *pages; /* item i is page pages[i % npages] of pair i / npages
	                              * (gpu_pages_alloc: the pairs' addresses follow the list) */
	struct gpx_wire_page *plist; /* or a private page list read in place (host path), item i
	                              * as in pages; then segs is NULL too */
	uint32_t npages;
	uint64_t page_size;
	uint64_t charged;            /* bytes of the budgets it holds (user.c) */
	uint64_t *blocks;            /* blocks[k]: bytes of the segments before (k + 1) * SEG_BLOCK
	                              * (of all, for the last block): chunking in O(log n) */
	uint32_t nseg;               /* segments, or items (pairs x pages) of a page job */
	uint64_t total;
	enum path_kind path;
	/* scheduling state, under the engine lock */
	uint32_t cur_seg;
	uint64_t cur_off;
	uint64_t handed;             /* bytes given to workers: where the next chunk starts */
	int chunks_out;
	bool handed_out;             /* every byte given to a worker */
	bool cancelled;
	bool failed;
	uint64_t done;
	double t_build;              /* when xfer_build began (with debug logging only) */
	double t_submit;
	double t_start;              /* when a worker took its first chunk */
	double t_recv;               /* stage clocks: when the loop last read a client's message */
	double t_launched;           /* GPU paths: when its first chunk was queued on a stream */
	double t_gpu_start;          /* when the GPU reached it (GPXD_STAGE_CLOCKS=1 only) */
	void *priv;                  /* back end state */
};

/* A piece of a job handed to one worker: `bytes` from segment `seg` at offset `off` on. */
struct chunk {
	struct job *job;
	uint32_t seg;
	uint64_t off;
	uint64_t bytes;
	uint32_t pieces;             /* segments (or parts of them) the chunk touches */
};

int engine_init(int workers, uint64_t chunk);
/* Hears every finished transfer (any thread, before its completion is posted): the metrics. */
void engine_on_done(void (*fn)(const struct job *, int status));
void engine_shutdown(void);
/* Takes ownership of the job (its segments and region users). */
void engine_submit(struct job *);
int engine_cancel(uint64_t client, uint64_t tag);    /* jobs cancelled */
void engine_cancel_client(uint64_t client);
void engine_cancel_all(int status);                  /* at shutdown: status for the records */
uint32_t engine_inflight(void);
typedef void (*engine_visit_fn)(const struct job *, void *);
void engine_visit(engine_visit_fn, void *);
/* For back ends: the next chunk of the path, round-robin over uids, their clients, their jobs. */
bool engine_next_chunk(enum path_kind, struct chunk *, bool wait, uint64_t max_bytes, uint32_t max_segs);
/*
 * The same from the first small job (ENGINE_SMALL_JOB bytes or less), never waiting: what a
 * back end whose large copies fill its queues may still take, so that small copies pass them.
 */
#define ENGINE_SMALL_JOB (1u << 20)
bool engine_next_small_chunk(enum path_kind, struct chunk *, uint32_t max_segs);
bool engine_has_work(enum path_kind);
uint32_t engine_pair_of(const struct job *, uint32_t seg);
int engine_queues(enum path_kind);   /* connections with work on the path (a hint) */
enum path_kind engine_path_for(const struct region *src, const struct region *dst);
void engine_chunk_done(struct chunk *, bool ok);
void engine_free_job(struct job *);
void engine_path_stats(enum path_kind, uint64_t *xfers, uint64_t *bytes, uint64_t *errors);
const char *engine_path_name(enum path_kind);
/*
 * Where a transfer's time goes, summed over every finished job (a few clock reads and atomic
 * adds each): received -> checked -> taken by a worker -> first chunk launched -> GPU started
 * -> last byte done -> completion written and doorbell rung.  Without GPXD_STAGE_CLOCKS=1 the
 * GPU's start is not marked, and STAGE_COPY runs from the launch (on the host path, from the
 * worker's taking the job).
 */
enum engine_stage { STAGE_CHECK, STAGE_QUEUE, STAGE_LAUNCH, STAGE_GPU_WAIT, STAGE_COPY, STAGE_POST, NSTAGES };
#define STAGE_BUCKETS 14
extern const double engine_stage_bounds[STAGE_BUCKETS];
const char *engine_stage_name(enum engine_stage);
void engine_stage_stats(enum engine_stage, uint64_t *count, double *seconds, uint64_t buckets[STAGE_BUCKETS + 1]);

/* ---- conn.c: connections, the Hello state machine and the message dispatcher ---- */
enum conn_state { CONN_HELLO, CONN_READY, CONN_DRAINING, CONN_DEAD };

struct conn {
	TAILQ_ENTRY(conn) entry;
	uint64_t id;
	uint32_t epoch;
	int fd;
	struct event *ev;
	enum conn_state state;
	uid_t uid;
	gid_t gid;
	pid_t pid;
	int pidfd;
	struct event *pidev;
	gid_t groups[64];            /* supplementary groups (SO_PEERGROUPS) */
	int ngroups;
	char name[65];
	struct user *user;
	struct cq *cq;
	bool admin;
	double t_connect;
	double t_last;
	uint32_t next_serial;
	uint32_t pending;            /* deferred operations still holding this connection */
	struct rhandle **htab;       /* chained hash of handles by serial */
	uint32_t nhandles, hcap;
	uint32_t nseq_errors;
	uint64_t sq_head;            /* submissions taken from the shared queue (our copy) */
	struct logrl log;            /* its share of the log (log.c) */
	uint32_t version;            /* the protocol it speaks (Hello) */
	const unsigned char *area;   /* the segment area, mapped read-only */
	size_t area_len;
	struct xfer_check *checking; /* a transfer whose lists a task thread checks: its further
	                              * messages and submissions wait (xfer.c) */
	uint64_t entries;            /* bytes its table entries hold against its budgets (user.c) */
};
TAILQ_HEAD(conn_list, conn);
extern struct conn_list conns;
extern double conn_last_input;      /* when any client last sent something (now_s) */
struct conn *conn_new(int fd);
/*
 * A connection accept(2) returned: admitted by the limits on connections (per uid, hello_max,
 * and with admins_only, root and the admin group only) or refused at once, with one Reply that
 * says why and no descriptor opened.  Takes fd either way.
 */
struct conn *conn_accept(int fd, bool admins_only);
struct creds conn_creds(const struct conn *);
void conn_input(struct conn *);
void conn_kill(struct conn *, const char *why);
void conn_reap(void);
/* Looks the admin group up now (at start and reload), with a warning when there is none. */
void conn_admin_check(void);
/* The log's lines about a client, within its share and its uid's (log.c): a refusal, or any line. */
void log_audit(struct conn *, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void log_client(struct conn *, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/*
 * A table entry of c's (a region, an import, an export, a request waiting for its reply) of
 * bytes, charged before it is allocated to its connection's, uid's and the daemon's budgets:
 * 0, or the refusal naming the budget (logged), what naming the request.  Given back with
 * conn_uncharge when the entry goes.  Loop thread.
 */
int conn_charge(struct conn *, uint64_t bytes, const char *what, char *err, size_t errlen);
void conn_uncharge(struct conn *, uint64_t bytes);
/* A deferred operation of the connection ended (c->pending--); a dead one is reaped after its last. */
void conn_settle(struct conn *);
int conn_poll_sq(struct conn *);      /* takes queued submissions; returns how many */
enum { SQ_POLL, SQ_POLLING, SQ_SLEEPING };
int conn_poll_all(int mode);          /* every connection's queue (and, by mode, sq_wakeup) */
uint32_t conn_count(void);
struct conn *conn_by_id(uint64_t);
struct rhandle *conn_handle(struct conn *, uint64_t id);
int conn_reply(struct conn *, uint32_t seq, int status, const char *msg, Gpx__Reply *body, const int *fds, int nfds);

/* ---- export.c: names under which regions are shared ---- */
struct export {
	TAILQ_ENTRY(export) entry;
	char name[65];
	struct region *r;
	uint64_t owner;
	uint64_t owner_region;
	uid_t uid;
	Gpx__ExportRule rule;
	gid_t gid;
	bool read_only;
	bool notify;
	uint32_t importers;
	bool remote;                 /* other nodes' daemons may import it (daemon/fabric/) */
	char *peers;                 /* "a,b": only these peer nodes; NULL = any authenticated peer */
	uint64_t *charged_to;        /* its owner connection's entries (conn.entries), */
	uint64_t charged;            /* and what it holds there, given back when it goes */
};
TAILQ_HEAD(export_list, export);
extern struct export_list exports;
struct export *export_find(const char *name);
bool export_name_ok(const char *name);
bool export_allows(const struct export *, const struct creds *);
/* A node name as exports' peer lists and the fabric spell it: 1..64 of [A-Za-z0-9._-]. */
bool export_node_name_ok(const char *name);
/* The remote fields of an Export message into e (remote, peers); <0 (a gpx status) on bad input. */
int export_remote_opts(struct export *e, const Gpx__Export *m, char *err, size_t errlen);
/* Whether a remote export admits the peer node named node (its list, or any). */
bool export_admits_peer(const struct export *, const char *node);
void export_remove(struct export *);
void export_remove_region(struct region *);
uint32_t export_count(void);

/* ---- xfer.c: turning a Transfer message into a checked job ---- */
void xfer_help(void);
/*
 * Loop thread: a Transfer's jobs in *out (several for a batch over several paths, linked by
 * gnext), or a refusal (<0, err set).  When later is not NULL and the request's lists are long,
 * they are checked on a task thread instead: then 0, *out NULL, *later set and c->checking
 * with it; the caller runs xfer_check_run(*later) on a task thread and xfer_check_end back on
 * the loop thread, which says what xfer_build would have.  A memfd of segments (*segfd) is
 * then the check's, and *segfd -1.
 */
int xfer_build(struct conn *, const Gpx__Transfer *, int *segfd, struct job **out, struct xfer_check **later,
    char *err, size_t errlen);
void xfer_check_run(struct xfer_check *);        /* any thread */
int xfer_check_end(struct xfer_check *, struct job **out, char *err, size_t errlen);
/* Loop thread, at the end of each turn: the bytes of lists the loop checked in it. */
uint64_t xfer_turn_end(void);
int xfer_set_area(struct conn *, int fd, uint64_t length, char *err, size_t errlen);
/* bytes at off of the connection's segment area, 8-byte aligned and inside it, or NULL. */
const unsigned char *xfer_area(const struct conn *, uint64_t off, uint64_t bytes);
void xfer_drop_area(struct conn *);

/* ---- ctl.c: answers to Query and Admin ---- */
void ctl_query(struct conn *, uint32_t seq, const Gpx__Query *);
void ctl_admin(struct conn *, uint32_t seq, const Gpx__Admin *);

/* ---- metrics.c: the Prometheus endpoint ([daemon] metrics), off by default ---- */
/* Loop thread: starts the endpoint cfg asks for (a bad address is fatal). */
int metrics_start(struct event_base *);
/* Loop thread: starts, moves or stops it to match n, a reload's; -1 (err set) keeps the old one. */
int metrics_reload(const struct conf *n, char *err, size_t errlen);
/* Whether spec is an address the endpoint may serve on ("off" and empty are); -1 with err. */
int metrics_check(const char *spec, bool allow_remote, char *err, size_t errlen);
void metrics_stop(void);
/* Any thread: one finished transfer, reported before its completion is posted. */
void metrics_job_done(const struct job *, int status);
/* Loop thread: a transfer refused before it became a job (bounds, rights, regions). */
void metrics_refused(const struct conn *, int status);

/* ---- levent.c: the event loop, listening socket, signals, timers ---- */
struct event_base *levent_base(void);
/* What the command line fixed, which a reload keeps (main.c). */
struct gpxd_args {
	const char *socket;          /* -s, or NULL */
	bool log_fixed;              /* -d or -D: the log level is the command line's */
};
int levent_run(const struct gpxd_args *);
void levent_conn_watch(struct conn *);
void levent_conn_unwatch(struct conn *);
void levent_conn_pause(struct conn *, bool pause);   /* stops (or resumes) reading its socket */
void levent_request_reap(void);
void levent_stop(int status);
/* Rereads the file: 0 with the report (what changed, live or at restart) in msg, or -1 with why. */
int levent_reload(char *msg, size_t msglen);
double now_s(void);
/*
 * Loop thread: a callback begins (now_s is returned) and ends.  The longest such turn, the most
 * bytes of request lists one turn checked (xfer.c bounds that), and with GPXD_LOOP_CLOCKS=1 the
 * most CPU time of the loop thread one turn took (else -1).
 */
double levent_turn_begin(void);
void levent_turn(double since);
double levent_turn_max(void);
uint64_t levent_turn_list_max(void);
double levent_turn_cpu_max(void);

/* ---- gpu.c: the GPU back end (CUDA driver API, loaded at run time) ---- */
int gpu_init(char *why, size_t whylen);
int gpu_count(void);
const char *gpu_status(void);
/* What an idle copy worker lends its core to (xfer_help: a long page list's check), set at start. */
void gpu_on_idle(void (*fn)(void));
void gpu_topo(Gpx__QueryReply *);
void gpu_topo_free(Gpx__QueryReply *);
const char *gpu_pci(int dev);                /* its PCI bus id, NULL for none */
void gpu_host_register(struct region *);     /* pins a host mapping for DMA, best effort */
/* The node's cache of opened GPU handles (gpu-map.c, vmm.c), for gpxctl status. */
struct gpu_cache {
	uint32_t ipc, pool;      /* allocations held open: legacy IPC (node-wide), pool */
	uint32_t vmm;            /* VMM pieces held (per connection) */
	uint64_t opens;          /* driver opens and imports */
	uint64_t hits;           /* registrations served from what was held, no driver call */
};
void gpu_cache_stats(struct gpu_cache *s);
bool gpu_released(struct region *r);        /* the driver has let go of r's memory */
bool gpu_vmm_fd_ok(int fd, char *err, size_t errlen);  /* cheap type check before any driver call */
int gpu_dev_by_uuid(const uint8_t uuid[16]);            /* -1: no such GPU here */
/*
 * A page transfer of npairs pairs that the copy kernel would run: room for its page list (n
 * struct gpx_wire_page) in pinned memory the kernel reads in place, followed by the pairs'
 * addresses (filled in here from their regions and bases), and in *dev the GPU whose worker
 * runs it; else NULL (then the pages go as plain segments).  Freed with gpu_pages_free.
 */
struct gpx_wire_page *gpu_pages_alloc(const struct jpair *pairs, uint32_t npairs, uint64_t page_size,
    uint32_t n, int *dev);
void gpu_pages_free(struct gpx_wire_page *);

/* ---- vmm.c: cuda-vmm memory, mirrors of clients' reservations (mem_cuda_vmm_ops) ---- */
int vmm_check(const struct region *r, char *err, size_t errlen);
int vmm_bind(struct region *r, uint32_t *missing, uint32_t *nmissing, char *err, size_t errlen);
int vmm_import(uint64_t owner, int dev, uint64_t res, uint64_t res_size, const struct gpx_wire_piece *pc,
    const int *fds, uint32_t n, char *err, size_t errlen);
void vmm_sweep(uint64_t owner);
void vmm_park(uint64_t owner, const int *fds, uint32_t n);   /* a Pieces message's fds, closed later */
uint64_t vmm_stats(uint64_t *hits, uint32_t *pieces);    /* imports; hits and pieces held */
void gpu_host_unpin(void *map);         /* undoes gpu_host_register; may block */
void gpu_shutdown(void);

extern double gpxd_start_time;
extern const char *gpxd_socket_path;

#endif
