/*
 * The transfer engine (engine/), as the layers above see it: a Transfer message checked and
 * built into jobs against its regions, segments, pages and budgets (xfer.c, xfer-pages.c),
 * and the jobs queued per path, round-robin between uids, their clients and their jobs, cut
 * into chunks, cancelled and completed, with the host path's workers (engine.c).
 *
 * It calls down only: the GPU back end (gpu/: page lists for the copy kernel), host memory
 * (host/: the host path's copy), the fabric (fabric/: the kick of PATH_FABRIC, the check of a
 * remote pair) and the core.  What it hears from below comes through what it registers at
 * engine_init: its chunk source, handed to each back end (gpu_chunks_from,
 * fabric_chunks_from).  It knows no connection: xfer_build takes what it needs of the asker
 * as a struct xfer_from; a finished job's news goes up through engine_on_done and its
 * completion queue.  xfer-private.h is the folder's own header.
 */
#ifndef GPX_ENGINE_ENGINE_H
#define GPX_ENGINE_ENGINE_H

#include "daemon/gpxd.h"

/* ---- engine.c: jobs, per-path queues, chunks, round-robin, the host path ---- */
int engine_init(int workers, uint64_t chunk);
/* Hears every finished transfer (any thread, before its completion is posted): the metrics. */
void engine_on_done(void (*fn)(const struct job *, int status));
void engine_shutdown(void);
/* Takes ownership of the job (its segments and region users). */
void engine_submit(struct job *);
void engine_submit_many(struct job *const *, int n);     /* the same, under one lock */
int engine_cancel(uint64_t client, uint64_t tag);    /* jobs cancelled */
void engine_cancel_client(uint64_t client);
void engine_cancel_all(int status);                  /* at shutdown: status for the records */
uint32_t engine_inflight(void);
typedef void (*engine_visit_fn)(const struct job *, void *);
void engine_visit(engine_visit_fn, void *);
/* For back ends: the next chunk of the path, round-robin over uids, their clients, their jobs. */
bool engine_next_chunk(enum path_kind, struct chunk *, bool wait, uint64_t max_bytes, uint32_t max_segs);
/* Up to n chunks of the first small jobs (ENGINE_SMALL_JOB bytes or less), never waiting. */
int engine_next_small_chunks(enum path_kind, struct chunk *, int n, uint32_t max_segs);
bool engine_has_work(enum path_kind);
void engine_nap(enum path_kind, uint64_t ns);
bool engine_idle(enum path_kind, uint64_t ns);
/* A request for the path is built, its check to come: an idle worker of it looks (engine_idle). */
void engine_prewake(enum path_kind);
uint64_t engine_prewakes(void);      /* engine_prewake calls that found a worker waiting */
/* A hint (budget_warm): the engine's lines that handing a job of this connection to the path
 * writes (q and u may be NULL: a request built without them, as the unit tests build some). */
void engine_warm(enum path_kind, const struct cq *, const struct user *);
uint32_t engine_pair_of(const struct job *, uint32_t seg);
int engine_queues(enum path_kind);   /* connections with work on the path (a hint) */
enum path_kind engine_path_for(const struct region *src, const struct region *dst);
void engine_chunk_done(struct chunk *, bool ok);
void engine_chunks_done(struct chunk *, int n, bool ok);  /* c[0..n), together */
void engine_chunk_nomem(struct chunk *);                  /* failed: no memory for it */
bool engine_chunk_soon(const struct chunk *);
void engine_chunk_warm(const struct chunk *);
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

/* ---- xfer.c: turning a Transfer message into a checked job ---- */
void xfer_help(void);
/*
 * Who asks for a transfer, as xfer_build needs it: the connection's layer fills it in for the
 * request and keeps what it points to alive until xfer_build returns.
 */
struct xfer_from {
	uint64_t client;             /* its id */
	uint32_t epoch;              /* of its region ids: another's are refused as not its own */
	uint32_t version;            /* the protocol it speaks */
	struct cq *cq;
	uint64_t *entries;           /* the bytes its table entries hold, of its connection's budget */
	struct user *user;
	const unsigned char *area;   /* its segment area (xfer_set_area), or NULL */
	size_t area_len;
	struct logwho who;           /* its share of the log, for refusals */
	/* the region its id names, with whether its handle is read-only; NULL if none */
	struct region *(*region)(void *arg, uint64_t id, bool *read_only);
	void *arg;
	struct xfer_pairs **pairs;   /* its last batch's pairs, resolved (or NULL: none kept) */
	uint64_t *pairs_seen;        /* a fingerprint of the last records resolved and not kept */
};
/*
 * A connection's last batch's pair records with their regions (held) and paths: a batch of
 * the same records takes them from there instead of resolving and holding each again (xfer.c).
 * Its bytes are charged to the connection's entries; the connection drops it (xfer_pairs_drop)
 * whenever it lets go of a handle, and when it ends, and so does the revocation of any region
 * it names.  A job that uses it holds a reference (xfer_pairs_unref, any thread).
 */
struct xfer_pairs;
void xfer_pairs_drop(struct xfer_pairs **);
/* budget_charge, what *kp keeps (by choice) giving way first when that makes room; kp may be NULL. */
int xfer_pairs_charge(struct xfer_pairs **kp, struct charge *, uint64_t bytes, char *err, size_t errlen);
void xfer_pairs_unref(struct xfer_pairs *);
void xfer_pairs_init(void);
void xfer_pairs_counts(uint64_t *lists, uint64_t *taken);   /* lists kept, batches taken from one */
/* Where p keeps its pairs' sides for its GPU (chunk_source.pairs_at), and how many pairs. */
struct gpu_pair_at *xfer_pairs_at(struct xfer_pairs *p, uint32_t *np);
/*
 * Loop thread: a Transfer's jobs in *out (several for a batch over several paths, linked by
 * gnext), or a refusal (<0, err set).  When later is not NULL and the request's lists are long
 * (past what the loop checks in one turn), they are checked on a task thread instead: then 0,
 * *out NULL and *later set; the caller runs xfer_check_run(*later) on a task thread and
 * xfer_check_end back on the loop thread, which says what xfer_build would have (gone: the
 * asker has left meanwhile; its jobs are dropped).  Until then the caller holds the asker's
 * further requests back, keeps what its struct logwho and entries point to alive, and passes
 * the check to xfer_drop_area.  A memfd of segments (*segfd) is then the check's, and *segfd -1.
 */
struct xfer_check;
int xfer_build(const struct xfer_from *, const Gpx__Transfer *, int *segfd, struct job **out,
    struct xfer_check **later, char *err, size_t errlen);
void xfer_check_run(struct xfer_check *);        /* any thread */
int xfer_check_end(struct xfer_check *, bool gone, struct job **out, char *err, size_t errlen);
/* A client's segment area: its memfd of length bytes mapped read-only, replacing the last one. */
int xfer_set_area(const unsigned char **area, size_t *area_len, int fd, uint64_t length, char *err,
    size_t errlen);
/* Unmapped on a task thread; one that checking still reads, once that check ends. */
void xfer_drop_area(const unsigned char **area, size_t *area_len, struct xfer_check *checking);
/* bytes at off of a segment area, 8-byte aligned and inside it, or NULL. */
const unsigned char *xfer_area(const unsigned char *area, size_t area_len, uint64_t off, uint64_t bytes);

#endif
