/*
 * The clients' side of gpxd (client/), as levent.c and main.c see it: a connection from
 * accept to its end, Hello, the dispatcher and the handlers of every request (conn*.c), the
 * handle tables, the exports by name (export.c), the answers to gpxctl (ctl.c) and the
 * Prometheus endpoint (metrics.c).
 *
 * It is the top layer of requests and calls down into all the others: the engine (engine/),
 * the cluster (cluster/), the fabric (fabric/), host memory (host/), the GPU back end (gpu/)
 * and the core.  What the event loop does for it comes through struct conn_loop, handed over
 * at conn_init; it calls nothing of levent.c.  conn-private.h is the private header of the
 * conn files.
 */
#ifndef GPX_CLIENT_CLIENT_H
#define GPX_CLIENT_CLIENT_H

#include "daemon/gpxd.h"

/* ---- conn.c: connections, the Hello state machine and the message dispatcher ---- */
enum conn_state { CONN_HELLO, CONN_READY, CONN_DRAINING, CONN_DEAD };
struct xfer_check;                   /* engine.h */

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
	uint32_t hswept;             /* gone: the slots of htab given back so far (handles_release) */
	uint32_t nseq_errors;
	uint64_t sq_head;            /* submissions taken from the shared queue (our copy) */
	bool sq_more;                /* its last pass was cut at the turn's slice: more wait there */
	/*
	 * A message read while submissions queued before it still waited (the turn's slice came,
	 * or a list went to a task thread): kept with its descriptors, and charged to its entries,
	 * until they have been taken; no other message is read meanwhile (conn_input).
	 */
	unsigned char *held;
	size_t held_len;
	int held_fds[GPX_MAX_FDS], held_nfds;
	struct logrl log;            /* its share of the log (log.c) */
	uint32_t version;            /* the protocol it speaks (Hello) */
	const unsigned char *area;   /* the segment area, mapped read-only */
	size_t area_len;
	struct xfer_check *checking; /* a transfer whose lists a task thread checks: its further
	                              * messages and submissions wait (conn-xfer.c) */
	uint64_t entries;            /* bytes its table entries hold against its budgets (user.c) */
	struct xfer_pairs *pairs;    /* its last batch's pairs, resolved (xfer.c): dropped with any handle */
	uint64_t pairs_seen;         /* (xfer.c) */
};
TAILQ_HEAD(conn_list, conn);
extern struct conn_list conns;
extern double conn_last_input;      /* when any client last sent something (now_s) */
/*
 * What the event loop does for the connections, handed over by levent.c at start (conn_init);
 * until then (tests that drive connections directly) nothing: no timers, no events, no reload.
 */
struct conn_loop {
	struct event_base *base;     /* for the connections' own timers */
	void (*unwatch)(struct conn *);              /* its socket and pidfd are no longer watched */
	void (*pause)(struct conn *, bool pause);    /* stops (or resumes) reading its socket */
	void (*request_reap)(void);                  /* any thread: dead connections are freed soon */
	int (*reload)(char *msg, size_t msglen);     /* Admin's reload: gpxd.conf read again; 0, -ENOMEM or -1 */
};
extern const struct conn_loop *conn_loop;
void conn_init(const struct conn_loop *);
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
bool conn_reap(void);                /* true: more to give back, in a later turn */
/* Looks the admin group up now (at start and reload), with a warning when there is none. */
void conn_admin_check(void);
/* Whether the connection may make administrative requests now: 1, 0, -1 (its group's lookup failed). */
int conn_admin(const struct conn *);
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
/* Takes queued submissions, up to the turn's slice (then c->sq_more); returns how many. */
int conn_poll_sq(struct conn *);
enum { SQ_POLL, SQ_POLLING, SQ_SLEEPING };
int conn_poll_all(int mode);          /* every connection's queue (and, by mode, sq_wakeup) */
bool conn_sq_left(void);              /* a pass was cut since the last call: poll again before sleeping */
bool conn_sq_pending(void);           /* submissions queued and not yet taken, on any connection */
void conn_poll_forget(struct conn *); /* c goes: the next pass does not begin with it */
uint32_t conn_count(void);
struct conn *conn_by_id(uint64_t);
struct rhandle *conn_handle(struct conn *, uint64_t id);
int conn_reply(struct conn *, uint32_t seq, int status, const char *msg, Gpx__Reply *body, const int *fds, int nfds);

/* ---- conn-region.c: a connection's table of handles, each naming a region ---- */
struct rhandle {
	uint64_t id;                 /* epoch << 32 | serial: scoped to one connection */
	struct region *r;
	bool imported;
	bool read_only;              /* this handle may only be a source */
	struct rhandle *next;        /* hash chain */
	uint64_t charged;            /* bytes of its connection's budgets it holds (conn_charge) */
};

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
bool export_allows(const struct export *, const struct creds *);
/* The remote fields of an Export message into e (remote, peers); <0 (a gpx status) on bad input. */
int export_remote_opts(struct export *e, const Gpx__Export *m, char *err, size_t errlen);
/* Whether a remote export admits the peer node named node (its list, or any). */
bool export_admits_peer(const struct export *, const char *node);
void export_remove(struct export *);
void export_remove_region(struct region *);
uint32_t export_count(void);
/* Our exports as the fabric serves them to peers (fabric_exports_from, at conn_init). */
extern const struct fabric_exports export_peer_ops;

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

#endif
