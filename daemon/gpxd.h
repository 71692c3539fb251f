/*
 * gpxd internals: what every layer of the daemon shares, and the face of the lowest one, the
 * core (daemon/core/): the log, gpxd.conf, systemd, task threads, uids and their budgets, the
 * memory kinds' interface and struct region, completion queues, the paths and the jobs and
 * chunks the engine hands its back ends, the names of exports and nodes, the clock and the
 * loop's turns.  Each block below belongs to one file of core/, whose name is the functions'
 * prefix (log_* in log.c, cq_* in cq.c, ...; the loop's turns, loop_turn_* in gpxd.c).  The
 * core calls nothing of the layers above it; what it must tell them goes through the callbacks
 * they register (region_on_gone, cq_set_broken_hook, conf_add_section, conf_metrics_check).
 *
 * The layers, top down, each with one header that is its face (the README's Layout draws
 * them): levent.c and main.c (levent.h); client/ (client.h); engine/ (engine.h); cluster/
 * (cluster.h); fabric/ (fabric.h); host/ (host.h); gpu/ (gpu.h); core/ (this header).  A file
 * calls and includes only its own folder and the faces of the layers below it
 * (build-aux/layers.test checks it).  The daemon is built as libgpxd.a plus a tiny main.c,
 * so the tests link the same code.
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

struct event_base;
struct region;
struct job;

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
 * shares of the log.  Built by the callers (conn_who for log_audit and log_client in
 * client/conn.c, and for the refusals of a transfer, which get it in struct xfer_from;
 * log_uid in user.c): the log knows no connection or user.
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
/* [cluster] of gpxd.conf, parsed by daemon/cluster/conf.c (strings owned, NULL = unset). */
struct cluster_conf {
	char *etcd;                  /* "http://host:port,https://..."; NULL: the cluster is off */
	char *prefix;                /* keys live under it; NULL = "/gpx" */
	uint32_t lease_ttl;          /* seconds; 0 = 10 */
	char *cacert, *cert, *key;   /* TLS to etcd */
	char *auth_file;             /* "user:password" for etcd's own authentication */
};

static inline bool
cluster_configured(const struct cluster_conf *cc)
{
	return cc->etcd != NULL;
}

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
	int sm_copy_blocks;          /* the most blocks of a copy kernel's launch */
	/* per-uid limits */
	uint32_t max_conns_per_uid;
	uint32_t max_regions_per_uid;
	uint64_t max_region_bytes_per_uid;
	uint32_t max_exports_per_uid;
	uint32_t max_inflight_per_uid;
	uint32_t max_mappings;       /* of clients' memory in gpxd, all clients (user.c: maps_take) */
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
/* The check of [daemon] metrics (an address the endpoint may serve on), registered before the
 * first conf_load by the code that serves it: a file is checked whole before it is used. */
void conf_metrics_check(int (*)(const char *spec, bool allow_remote, char *err, size_t errlen));
int conf_defaults(struct conf *);       /* 0, or -1: out of memory (then conf_free it) */
int conf_load(struct conf *, const char *path, char *err, size_t errlen);   /* 0, -ENOMEM, or -1 */
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
struct conf *conf_new(void);         /* defaults, one reference; NULL: out of memory */
const struct conf *conf_hold(void);
void conf_drop(const struct conf *);
const struct conf *conf_refresh(const struct conf *held);
/* Loop thread: n becomes cfg; the old snapshot is freed when its last holder drops it. */
void conf_publish(struct conf *n);
/*
 * Loop thread: the keys on which two configurations differ, as "sec.key sec.key" (live ones
 * in live, the others in restart); restart keys of n are set back to old's values, so that n
 * says what runs.  Keys in `fixed` (space-separated sec.key, given on the command line) are
 * kept from old too and listed in overridden.  0, or -1 when a value could not be copied (out
 * of memory): n is then not to be used.
 */
int conf_diff(const struct conf *old, struct conf *n, const char *fixed, char *live, char *restart,
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
/*
 * A task's place in defer.c's queues, a member of the record its work and done functions
 * take: queueing work allocates nothing, so it cannot fail for want of memory.  Owned by
 * defer.c from defer_run until done is called; done may free the record (free itself serves
 * as done for a record that needs nothing more), work must not.
 */
struct defer_task {
	STAILQ_ENTRY(defer_task) entry;
	struct defer_task *next_done;
	defer_fn work, done;
	void *arg;
};
int defer_init(struct event_base *, int threads);
void defer_shutdown(void);
/* Runs work(arg) on a task thread, then done(arg) on the loop thread, queued through t. */
void defer_run(struct defer_task *t, defer_fn work, defer_fn done, void *arg);

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
	atomic_uint pooled;          /* grains of a shared pool it holds (struct pool: the page arena) */
	struct logrl log;            /* its share of the log (log.c) */
	struct uqueue *uq;           /* its queues, one per path (engine.c, engine lock) */
	TAILQ_ENTRY(user) entry;
};
struct user *user_get(uid_t);      /* NULL: a uid not seen before, and no memory for it */
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
	bool optional;               /* gpxd's own choice (a cache): a refusal is not counted */
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
/*
 * Asks the cache for the lines a charge and a release of a connection's transfer write (its
 * queue's and uid's counts, the totals), without waiting: the other thread wrote them last (the
 * loop at the check, a copy worker at the end), and fetched together their misses overlap
 * instead of following one another.  A hint: nothing is read or changed.
 */
void budget_warm(const struct cq *, const struct user *);
void budget_entry_release(uint64_t *entries, struct user *, uint64_t bytes);
const char *budget_name(enum budget_scope);
uint64_t budget_limit(enum budget_scope);
uint64_t budget_used(void);              /* the daemon's total */
uint64_t budget_entries(void);           /* of it, what entries hold */
uint64_t budget_refused(enum budget_scope, bool busy);
/*
 * Mappings.  Each host region, completion ring and segment area a client makes gpxd map is one
 * mapping of gpxd's, and the kernel gives a process vm.max_map_count of them (65,530 by
 * default): past that every mmap of gpxd fails, its own and every tenant's.  So they are
 * counted against limits.mappings (three quarters of vm.max_map_count unless set), taken on
 * the loop thread before the mmap, given back by whichever thread lets the mapping go.
 * maps_take: 0, or -GPX__STATUS__EBUSY with why in err.
 */
int maps_take(const char *what, char *err, size_t errlen);
void maps_give(void);
uint32_t maps_used(void);
uint64_t maps_refused(void);             /* requests refused by it */
uint32_t maps_default(void);             /* three quarters of vm.max_map_count */
/*
 * A pool of fixed size that transfers in flight hold runs of, shared by the uids: the page
 * kernel's pinned arena (gpu-copy.c).  One uid holds at most its share (half the pool), so
 * that another always finds that much not held by it, though maybe not in one run: a take
 * goes to the shortest free run that holds it, so that short lists fill holes and long runs
 * stay whole, but one uid's runs can still leave the rest in pieces.  The caller locks.
 * pool_take: the run's first grain, or -ENOSPC (no free run that long), -EDQUOT (the uid's
 * share would be passed) or -E2BIG (longer than a share: never).
 */
struct pool {
	uint32_t grains;             /* in all */
	uint32_t share;              /* the most one uid holds */
	uint16_t *len;               /* at a run's first grain: its grains; 0: none starts there */
	struct user **owner;         /* at a run's first grain: who holds it */
	bool *used;
	uint64_t refused[2];         /* takes refused: [0] no free run, [1] the uid's share */
};
int64_t pool_take(struct pool *, uint32_t need, struct user *);
void pool_give(struct pool *, uint32_t first);

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
	/*
	 * Two counts in one word (region.c), so that a job takes and gives back both with one
	 * atomic operation: refs in the low half, the lifetime of this struct (handles + jobs);
	 * users in the high half, the lifetime of the mapping (owner handle + jobs).  The word
	 * has a cache line of its own: the event loop writes it at every check and a copy worker
	 * at every job's end, while the worker reads the fields below as it issues the job's
	 * pieces; in one line with them, each of those reads waited for the line to come back
	 * from the loop's core (region_new allocates the struct on a line's boundary).
	 */
	_Alignas(64) _Atomic uint64_t counts;
	_Alignas(64) atomic_bool revoked;
	uint32_t kept_by;            /* loop thread: batches' pairs kept resolved that name it (xfer.c) */
	const struct mem_ops *ops;
	Gpx__MemKind kind;
	int dev;                     /* DEV_HOST or a gpu index */
	void *host;                  /* host-addressable pointer (host kind) */
	uint64_t dptr;               /* device address in the daemon's context (GPU kinds) */
	uint64_t length;
	bool read_only;
	bool map_counted;            /* its mapping counts against limits.mappings until it goes */
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


/* ---- region.c: regions, their references and revocation ---- */
struct region *region_new(void);
void region_init(struct region *);
void region_ref(struct region *);
void region_unref(struct region *);
bool region_use(struct region *);   /* takes a mapping user; false if revoked */
void region_unuse(struct region *);
bool region_hold(struct region *);  /* a user and a reference at once; false if revoked */
/* A hint (budget_warm): the line of the counts that region_hold and region_drop write. */
#define region_warm(r) __builtin_prefetch(&(r)->counts, 1)
void region_drop(struct region *);  /* gives both back */
uint32_t region_refs(const struct region *);
uint32_t region_users(const struct region *);
void region_revoke(struct region *);
/*
 * What must let go of a region's memory before its kind closes the mapping (the fabric's RDMA
 * registrations): registered once at start by the layer that holds it; called from any thread.
 */
void region_on_gone(void (*)(struct region *));
/* Set once at start: called (loop thread) when a region that kept pairs name is revoked. */
void region_on_revoke(void (*)(struct region *));

/* ---- paths, and the engine's scheduling state kept in each uid and completion queue ---- */
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
/*
 * Three lines (cq_new allocates it on a line's boundary): what the event loop reads every time
 * it polls the submission queue, which nothing writes once the client is set up; the credit and
 * the post, written by the loop at each transfer's check and by a copy worker at its end; the
 * counts of both.  In one line, the loop's polling during a copy took the lock's line back from
 * the worker, which then waited for it again to post the copy's end (engine_chunk_warm).
 */
struct cq {
	struct gpx_ring_hdr *ring;
	size_t ring_len;
	int ring_fd;                 /* sent to the client once, then closed */
	int efd;                     /* the client's eventfd */
	uint32_t entries;
	uint64_t client;
	struct user *user;
	bool map_counted;            /* its ring counts against limits.mappings (maps_take) */
	_Alignas(64) pthread_mutex_t lock;
	uint32_t inflight;           /* accepted, not yet posted (under lock) */
	uint64_t head;               /* our copy of the ring's head: the shared one is never read back */
	bool broken;                 /* ring or eventfd misused: the loop disconnects the client */
	const char *broken_why;      /* how (a string constant) */
	_Alignas(64) atomic_int refs;
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
/* A hint (budget_warm): the lines cq_reserve reads and writes, the client's tail among them. */
void cq_warm(const struct cq *);
void cq_unreserve(struct cq *);
bool cq_busy(struct cq *);           /* whether transfers it accepted are still to be posted */
/* Posts the record of a reserved transfer and rings the doorbell (unless the client spins). */
void cq_post(struct cq *, uint64_t tag, int status, uint64_t bytes);
/*
 * Records posted together, as a copy worker finishes several transfers in one pass: one hold
 * of each queue's lock and one doorbell per queue for all of its records (a write that adds
 * their number to the eventfd's counter), each queue's in the order added.  An entry takes over
 * a reference on its queue, which the flush drops; the records are written at the flush (a
 * full set flushes itself).
 */
#define CQ_POSTS_MAX 64
struct cq_post {
	struct cq *q;
	uint64_t tag, bytes;
	int status;
};
struct cq_posts {
	int n;
	struct cq_post e[CQ_POSTS_MAX];
};
void cq_posts_add(struct cq_posts *, struct cq *, uint64_t tag, int status, uint64_t bytes);
void cq_posts_flush(struct cq_posts *);
/* Posts an unreserved notification if room is left, else counts it as dropped. */
void cq_notify(struct cq *, uint64_t tag, uint64_t region, uint64_t bytes);
void cq_set_broken_hook(void (*)(struct cq *));
/* Wakes a client thread asleep in a wait, with no record: one is due soon (cq_sleepers). */
void cq_wake(struct cq *);
bool cq_asleep(const struct cq *);   /* whether a thread of its client says it sleeps */
/* Since start: records whose doorbell was rung, records posted while the client looked at its
 * ring (none rung), doorbells rung early (cq_wake), and the eventfd writes of the records
 * rung (records posted together share one). */
void cq_doorbell_stats(uint64_t *rung, uint64_t *skipped, uint64_t *early, uint64_t *writes);
void cq_signal_init(void);       /* installs the doorbell timeout's signal handler */

/* ---- the work: what the engine (engine/) hands its back ends, as jobs and their chunks ---- */
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
	struct region *src, *dst;    /* the first pair's (the only one's, but for batches) */
	struct jpair *pairs;         /* &one, or a batch's */
	struct xfer_pairs *kept;     /* the kept pairs whose holds stand for the pairs' own, or NULL */
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
	struct region *list;         /* a page list in GPU memory (protocol 4), held until the job
	                              * ends, or NULL; then pages holds no list, only the pairs' */
	uint64_t list_addr;          /* ... its page numbers in the kernel's context (npages
	                              * source numbers, then npages destination numbers) */
	uint32_t lim_src, lim_dst;   /* ... the kernel copies a page only below these */
	volatile uint32_t *oob;      /* ... where it says that some page was not (pinned) */
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
	bool nomem;                  /* ... a chunk failed for want of memory: ENOMEM, not EIO */
	uint64_t done;
	double t_build;              /* when xfer_build began (with debug logging only) */
	double t_submit;
	double t_start;              /* when a worker took its first chunk */
	double t_recv;               /* stage clocks: when the loop last read a client's message */
	double t_launched;           /* GPU paths: when its first chunk was queued on a stream */
	double t_gpu_start;          /* when the GPU reached it (GPXD_STAGE_CLOCKS=1 only) */
	void *priv;                  /* back end state */
};

/*
 * A pair's two sides as the copy worker of the GPU that runs it issues them (gpu-copy.c), kept
 * beside a kept batch whose pairs all take that GPU's path (xfer.c), one per pair: found at
 * the first job, read by the next, so that a weight push of the same tensors walks only its
 * segments (338 pairs took 11-12 us to find again each time; gpu1-h100-launch-walk.txt).
 * Zero until found; only that GPU's worker writes them.  Charged with the batch's pairs.
 */
struct gpu_pair_at {
	uint64_t src, dst;
	uint32_t flags;
};

/* A piece of a job handed to one worker: `bytes` from segment `seg` at offset `off` on. */
struct chunk {
	struct job *job;
	uint32_t seg;
	uint64_t off;
	uint64_t bytes;
	uint32_t pieces;             /* segments (or parts of them) the chunk touches */
	bool last;                   /* no byte of its job is handed out after it */
};

/*
 * The engine's chunks, as its back ends take them (the GPU copy workers, the fabric's
 * requests): engine_init hands this table to each back end (gpu_chunks_from,
 * fabric_chunks_from), which reaches the engine through it alone.
 */
struct chunk_source {
	/* The next chunk of the path, round-robin over uids, their clients, their jobs. */
	bool (*next)(enum path_kind, struct chunk *, bool wait, uint64_t max_bytes, uint32_t max_segs);
	/* Up to n chunks (an array), each the first of a small job (ENGINE_SMALL_JOB bytes or
	 * less), together and never waiting: how many. */
	int (*next_small)(enum path_kind, struct chunk *, int n, uint32_t max_segs);
	bool (*has_work)(enum path_kind);
	/* Chunks c[0..n) are copied (ok) or failed; a job's last one finishes it.  Together: one
	 * lock, and one doorbell per client for the jobs they end. */
	void (*done)(struct chunk *c, int n, bool ok);
	/* As done, failed, for a chunk that found no memory: its job ends ENOMEM, not EIO. */
	void (*nomem)(struct chunk *c);
	uint32_t (*pair_of)(const struct job *, uint32_t seg);
	/* The sides of job j's pairs kept for its GPU (struct gpu_pair_at, j->npairs of them), or
	 * NULL: none kept for it. */
	struct gpu_pair_at *(*pairs_at)(const struct job *j);
	/* Waits up to ns, or until a new job comes for the path: a worker whose chunks are due later. */
	void (*nap)(enum path_kind, uint64_t ns);
	/* Waits up to ns, or until a new job comes or a request for the path is built
	 * (engine_prewake): an idle worker (true unless the time ran out). */
	bool (*idle)(enum path_kind, uint64_t ns);
	/* The last chunk of its job (c->last) should end in a little while: wakes a client that
	 * sleeps on its completion, so that it looks when the record comes (engine_chunk_soon).
	 * False while no thread of the client sleeps (it spins, say, and may sleep before the
	 * end): ask again a little later. */
	bool (*soon)(const struct chunk *);
	/* The last chunk of its job is on the device, alone there: fetches, without waiting, the
	 * lines its end writes, so that their misses do not come one after another once it ends
	 * (engine_chunk_warm). */
	void (*warm_end)(const struct chunk *);
	/* Chunks on the device end in a little while (a nap through them ran its length): wakes
	 * the event loop if it naps, so that it polls when the next request comes. */
	void (*ending)(void);
};
/* What a back end whose large copies fill its queues may still take (next_small), so that
 * small copies pass them. */
#define ENGINE_SMALL_JOB (1u << 20)

/* ---- names.c: the names of exports and nodes, as every layer checks them ---- */
bool export_name_ok(const char *name);      /* 1..64 of [A-Za-z0-9._:/-] */
/* A node name as exports' peer lists and the fabric spell it: 1..64 of [A-Za-z0-9._-]. */
bool export_node_name_ok(const char *name);

/* ---- gpxd.c: the daemon's clock, when it started, the socket it serves (set by levent.c) ---- */
double now_s(void);                 /* CLOCK_MONOTONIC, in seconds */
uint64_t now_ns(void);               /* CLOCK_MONOTONIC, in nanoseconds */
/* The number a file such as /proc/sys/vm/max_map_count holds; 0 if it cannot be read. */
unsigned long long sysctl_number(const char *path);
/* Names the calling thread "gpxd-" and the rest (top -H, /proc/PID/task/TID/comm): at its start. */
void thread_name(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
extern double gpxd_start_time;
extern const char *gpxd_socket_path;
/*
 * The loop's turns, loop thread only: a callback begins (now_s is returned) and ends
 * (levent.c's callbacks, defer.c's ends of tasks).  In between, the engine adds the bytes of
 * request lists it checks on the loop (loop_turn_checked) and reads what the turn has checked
 * so far (loop_turn_list), to keep it within a bound.  Kept: the longest turn, the most bytes
 * of lists one turn checked, and with GPXD_LOOP_CLOCKS=1 the most CPU time of the loop thread
 * one turn took (else -1).
 */
double loop_turn_begin(void);
void loop_turn_end(double since);
/*
 * Whether this turn has run LOOP_TURN_SLICE_S: a callback that takes one piece of work after
 * another (a connection's messages, a pass over the submission queues, a gone client's handles)
 * asks after each, stops there, having done at least one, and leaves the rest to the next turn.
 * False outside a turn.  Each call counts one piece: loop_turn_work_max is the most one turn did.
 */
#define LOOP_TURN_SLICE_S 0.5e-3
bool loop_turn_over(void);
uint32_t loop_turn_work_max(void);
/*
 * The loop naps in epoll while clients only wait for copies in flight; loop_wake (any thread,
 * after posting a completion) writes the eventfd it watches (loop_nap_init) if it naps.
 */
void loop_nap_init(int efd);
void loop_nap(bool on);
void loop_wake(void);
void loop_wake_early(void);         /* the same, a little before a copy's end (chunk_source.ending) */
/* Since start: naps; ended by loop_wake; by loop_wake_early. */
void loop_nap_counts(uint64_t *naps, uint64_t *wakes, uint64_t *early);
void loop_turn_checked(uint64_t bytes);
uint64_t loop_turn_list(void);
double loop_turn_max(void);
uint64_t loop_turn_list_max(void);
double loop_turn_cpu_max(void);
/*
 * The CPU times of the LOOP_TURN_TOP longest turns, longest first (NULL without
 * GPXD_LOOP_CLOCKS=1).  One may be the host's: where a virtual machine's host takes its CPU
 * away and the guest is not told (no steal time), the thread on it is charged for that time.
 */
#define LOOP_TURN_TOP 4
const double *loop_turn_cpu_top(void);

#endif
