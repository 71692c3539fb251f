/*
 * The cluster's files, shared by them only (the rest of the daemon sees cluster.h).  By job:
 *
 *   conf.c     [cluster] of gpxd.conf
 *   etcd.c     etcd's v3 JSON gateway over HTTP/1.1: libcurl's multi interface driven by the
 *              daemon's libevent loop, json-c for the bodies, base64 for keys and values
 *   member.c   the session with etcd: lease, this node's key, keep-alive, the watch of the
 *              prefix, what is known of the other nodes, retries while etcd is away
 *   names.c    cluster names: ours (registered under the lease, unique by transaction) and
 *              everyone's (from the watch), imports by bare name and "NODE:name"
 *
 * Keys, under [cluster] prefix (P):
 *   P/nodes/NODE   {"name","listen":[...],"transports":[...],"rdma":[...],"gpus":[...],
 *                   "proto","version","start"}
 *   P/names/NAME   {"node","uid","claim"} (claim: the claim's number in its node's daemon,
 *                   which makes each claim's value its own; readers need only "node", "uid")
 * Both under this node's lease: when it ends, etcd deletes them and every watcher hears it.
 * Everything read from etcd is a hint written by anyone who can write there: checked before
 * use, and a node dialled through it still proves the fabric's key.
 */
#ifndef GPX_CLUSTER_INTERNAL_H
#define GPX_CLUSTER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/queue.h>
#include <json-c/json.h>

#include "daemon/gpxd.h"
#include "daemon/cluster/cluster.h"
#include "daemon/gpu/gpu.h"

#define CLUSTER_VALUE_MAX 4096       /* a value larger than this is someone else's: ignored */
#define CLUSTER_NODE_MAX 64          /* node names, as the fabric's */

/* ---- etcd.c ---- */
struct etcd_call;
/* The end of a call: err 0 with the reply (borrowed for the call), or err < 0 and why.
 * err -1: etcd not reached; -2: etcd answered with an error; -3: no answer in time. */
#define ETCD_UNREACHABLE (-1)
#define ETCD_REFUSED (-2)
#define ETCD_TIMEDOUT (-3)
#define CLAIM_HELD (-4)              /* member_claim: another holds the key */
#define ETCD_NOMEM (-5)              /* an allocation here failed: the call was not made, or its answer lost */
#define CLAIM_CHANGED (-6)           /* member_claim: the key changed under each of its transactions */
typedef void (*etcd_fn)(void *arg, int err, struct json_object *reply, const char *why);
/* One JSON object of a streaming reply (the watch). */
typedef void (*etcd_msg_fn)(void *arg, struct json_object *msg);
int etcd_init(struct event_base *, const struct cluster_conf *, char *why, size_t whylen);
void etcd_shutdown(void);
/* POSTs body (taken over) to path ("/v3/kv/range"); done once, never before this returns. */
struct etcd_call *etcd_post(const char *path, struct json_object *body, double timeout, etcd_fn done, void *arg);
/* A streaming POST: msg for each object, then done when the stream ends. */
struct etcd_call *etcd_stream(const char *path, struct json_object *body, etcd_msg_fn msg, etcd_fn done, void *arg);
void etcd_cancel(struct etcd_call *);        /* done is not called */
/* [cluster] auth_file's user (NULL: none); a token for it, held for the calls from now on
 * (done: 0, or why, naming the user).  A call answered "invalid auth token" asks for a new
 * one by itself. */
const char *etcd_auth_user(void);
struct etcd_call *etcd_authenticate(etcd_fn done, void *arg);
const char *etcd_endpoint(void);            /* the URL now in use */
/* base64 of etcd's JSON: a fresh string; decoding NULL-terminates, NULL when malformed
 * (errno EINVAL) or out of memory (ENOMEM). */
char *b64_enc(const void *, size_t);
char *b64_dec(const char *, size_t *len);
/* JSON helpers: a string member (NULL if absent or not a string), an int64 (etcd sends
 * them as strings; 0 when absent). */
const char *js_str(struct json_object *, const char *key);
int64_t js_int(struct json_object *, const char *key);
/* json-c's allocations checked: v (taken over: freed when not added) added to object o
 * under name, or to array a; false when o (a) or v is NULL or the add found no memory. */
bool js_add(struct json_object *o, const char *name, struct json_object *v);
bool js_push(struct json_object *a, struct json_object *v);
/* Text parsed: NULL when it is no JSON, or (*nomem) when the parser found no memory to start. */
struct json_object *js_parse(const char *s, bool *nomem);
/* o as JSON text (malloc'ed), or NULL when an allocation failed: json-c's printer leaves out
 * what found no memory without saying so, so the text is parsed back and compared. */
char *js_text(struct json_object *o);
/* Counters (metrics). */
struct etcd_stats {
	uint64_t calls, failures;
	double rtt_sum;              /* seconds, over calls answered */
	uint64_t rtt_n;
	double rtt_last;
};
extern struct etcd_stats etcd_stats;

/* ---- member.c ---- */
enum member_state { M_DOWN, M_JOINING, M_UP };
struct member {
	enum member_state state;
	char self[CLUSTER_NODE_MAX + 1];
	char prefix[128];
	int64_t lease;
	uint32_t ttl;
	char why[320];               /* why it is not up */
	uint64_t renewals, watch_events, nodes_seen, rejoins;
	double t_renewed;            /* the lease's last keep-alive that etcd answered */
};
extern struct member mb;
/* A key of ours under the lease: put when nobody holds it (create_revision 0), or when it
 * is ours under another value (an earlier claim's: taken over); done gets 0 (also when it is
 * ours with this value already), or CLAIM_HELD with the holder's value in why (a JSON text),
 * or CLAIM_CHANGED, or another error. */
void member_claim(const char *key, const char *value, etcd_fn done, void *arg);
/* Deletes a key while it is ours (under our lease) and holds value: the call, whose done says
 * how it went (err 0 also when the key was not that), or NULL when it found no memory (done
 * not called). */
struct etcd_call *member_unput(const char *key, const char *value, etcd_fn done, void *arg);
/* The nodes known, from the watch. */
struct cnode {
	TAILQ_ENTRY(cnode) entry;
	char name[CLUSTER_NODE_MAX + 1];
	char addr[96];               /* its first fabric address, "" if none */
	int64_t lease;
	char *value;                 /* its key's JSON, as etcd holds it */
	uint32_t names;              /* cluster names it holds */
	bool stale;                  /* during a resync: not seen yet */
	int64_t ttl_left;            /* its lease's seconds left when last asked, -1: gone */
};
TAILQ_HEAD(cnode_list, cnode);
extern struct cnode_list cnodes;
struct cnode *member_node(const char *name);
/* A key the watch (or a range) told of was lost for want of memory: every key is read again. */
void member_lost(void);
/* Every key is to be read again, or its range is in flight: names may be missing till it ends. */
bool member_rereading(void);

/* ---- names.c ---- */
/* The watch, or the range of a resync, saw a name key: put (value) or deleted (NULL). */
void names_seen(const char *name, const char *value, size_t len);
void names_forget_all(void);                 /* a range of every key answered: before its keys */
void names_reclaim(void);                    /* a new lease: our names again under it */
void names_fail_waiting(const char *why);    /* etcd went away: waiting registrations fail */
void names_tick(void);                       /* the session is up: withdrawn names' keys deleted again */
size_t names_count(void);
uint32_t names_of_uid(uid_t);
void names_stop(void);                       /* at the stop, after etcd_shutdown */

#endif
