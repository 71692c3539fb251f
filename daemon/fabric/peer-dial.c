/*
 * How peer connections come to be.  Inbound: the listener on [fabric] listen accepts any
 * connection and hands it to peer.c, which trusts nothing of it until its handshake is done.
 * Outbound: an address (struct ptarget) is resolved on a task thread (getaddrinfo may block)
 * and then connected to without blocking.  A configured one ([fabric] peers) is dialled again
 * every [fabric] retry_interval while no connection reaches its node.  One dialled on demand,
 * for an import by address ([fabric] dial_on_demand), is never redialled by the tick: when its
 * connection is gone and no import waits for it, it is forgotten, and the next import by
 * address dials it again, so an address that was mistyped or went away costs nothing after
 * its last import.  The imports waiting for an address hear of it through peer-import.c.
 */
#include "config.h"

#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>

#include "daemon/fabric/internal.h"

static TAILQ_HEAD(, ptarget) targets = TAILQ_HEAD_INITIALIZER(targets);
static struct event_base *base;
static struct evconnlistener *listener;
static char listen_addr[96];
static bool running;

#define PEER_MAX_ON_DEMAND 64           /* addresses dialled on demand at once */

/* ---- addresses ---- */

/* "HOST:PORT" or "[V6]:PORT" into host and port; false if malformed. */
bool
peer_dial_split(const char *a, char *host, size_t hl, char *port, size_t pl)
{
	const char *c;

	if (a[0] == '[') {
		const char *e = strchr(a, ']');
		if (e == NULL || e[1] != ':' || (size_t)(e - a - 1) >= hl)
			return false;
		snprintf(host, hl, "%.*s", (int)(e - a - 1), a + 1);
		c = e + 1;
	} else {
		if ((c = strrchr(a, ':')) == NULL || (size_t)(c - a) >= hl || c == a)
			return false;
		snprintf(host, hl, "%.*s", (int)(c - a), a);
	}
	if (c[1] == '\0' || strlen(c + 1) >= pl || strspn(c + 1, "0123456789") != strlen(c + 1))
		return false;
	snprintf(port, pl, "%s", c + 1);
	return true;
}

static void
fmt_sa(const struct sockaddr *sa, char *buf, size_t len)
{
	char h[INET6_ADDRSTRLEN] = "?";

	if (sa->sa_family == AF_INET) {
		const struct sockaddr_in *s = (const void *)sa;
		inet_ntop(AF_INET, &s->sin_addr, h, sizeof(h));
		snprintf(buf, len, "%s:%u", h, ntohs(s->sin_port));
	} else if (sa->sa_family == AF_INET6) {
		const struct sockaddr_in6 *s = (const void *)sa;
		inet_ntop(AF_INET6, &s->sin6_addr, h, sizeof(h));
		snprintf(buf, len, "[%s]:%u", h, ntohs(s->sin6_port));
	} else
		snprintf(buf, len, "?");
}

/* ---- accepting ---- */

static void
on_accept(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int salen, void *arg)
{
	char addr[96];
	int one = 1;

	(void)l;
	(void)salen;
	(void)arg;
	fmt_sa(sa, addr, sizeof(addr));
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	struct bufferevent *bev = bufferevent_socket_new(base, fd, BEV_OPT_CLOSE_ON_FREE);
	if (bev == NULL) {
		close(fd);
		return;
	}
	if (peer_new(bev, false, addr) == NULL) {
		bufferevent_free(bev);
		return;
	}
	log_debug("fabric", "connection from %s", addr);
}

/* ---- dialling ---- */

struct resolve_op {
	struct defer_task task;        /* queued through it (defer.c) */
	struct ptarget *t;
	struct sockaddr_storage ss;
	socklen_t sslen;
	char err[128];
};

/* Task thread: name resolution may block. */
static void
resolve_work(void *arg)
{
	struct resolve_op *op = arg;
	struct addrinfo hints = { .ai_socktype = SOCK_STREAM }, *res;
	char host[80], port[16];
	int e;

	op->sslen = 0;
	if (!peer_dial_split(op->t->addr, host, sizeof(host), port, sizeof(port))) {
		snprintf(op->err, sizeof(op->err), "not HOST:PORT");
		return;
	}
	if ((e = getaddrinfo(host, port, &hints, &res)) != 0) {
		snprintf(op->err, sizeof(op->err), "%s", gai_strerror(e));
		return;
	}
	memcpy(&op->ss, res->ai_addr, res->ai_addrlen);
	op->sslen = res->ai_addrlen;
	freeaddrinfo(res);
}

static void
resolve_done(void *arg)
{
	struct resolve_op *op = arg;
	struct ptarget *t = op->t;

	t->resolving = false;
	if (!running) {
		free(op);
		return;
	}
	if (op->sslen == 0) {
		snprintf(t->why, sizeof(t->why), "cannot resolve: %s", op->err);
		t->t_next = now_s() + cfg->fabric_retry_s;
		free(op);
		peer_import_target_down(t, t->why);
		return;
	}
	struct bufferevent *bev = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
	struct peer *p = bev ? peer_new(bev, true, t->addr) : NULL;
	if (p == NULL) {
		if (bev != NULL)
			bufferevent_free(bev);
		snprintf(t->why, sizeof(t->why), "out of memory");
		t->t_next = now_s() + cfg->fabric_retry_s;
		free(op);
		peer_import_target_down(t, t->why);
		return;
	}
	p->target = t;
	t->p = p;
	if (bufferevent_socket_connect(bev, (struct sockaddr *)&op->ss, (int)op->sslen) < 0)
		peer_kill(p, "connect: %s", strerror(errno));
	free(op);
}

void
peer_dial(struct ptarget *t)
{
	struct resolve_op *op = calloc(1, sizeof(*op));

	if (op == NULL)
		return;
	op->t = t;
	t->resolving = true;
	defer_run(&op->task, resolve_work, resolve_done, op);
}

struct ptarget *
peer_dial_target(const char *addr, bool hinted, int *status, char *err, size_t errlen)
{
	struct ptarget *t;
	unsigned n = 0;

	TAILQ_FOREACH(t, &targets, entry) {
		if (strcasecmp(t->addr, addr) == 0)
			return t;
		n += t->on_demand;
	}
	/*
	 * Off by default: it lets any local client make the daemon open connections to any
	 * address it can reach, and learn from the errors which of them listen.
	 */
	if (!cfg->fabric_dial_on_demand && !hinted) {
		snprintf(err, errlen, "%s is not a configured peer, and [fabric] dial_on_demand is off", addr);
		*status = GPX__STATUS__EACCES;
		return NULL;
	}
	if (n >= PEER_MAX_ON_DEMAND) {
		snprintf(err, errlen, "%u addresses are being dialled on demand already", PEER_MAX_ON_DEMAND);
		*status = GPX__STATUS__EQUOTA;
		return NULL;
	}
	if ((t = calloc(1, sizeof(*t))) == NULL) {
		snprintf(err, errlen, "out of memory");
		*status = GPX__STATUS__ENOMEM;
		return NULL;
	}
	t->on_demand = true;
	snprintf(t->addr, sizeof(t->addr), "%s", addr);
	TAILQ_INSERT_TAIL(&targets, t, entry);
	return t;          /* with no import waiting for it, forgotten at the next tick */
}

void
peer_dial_lost(struct peer *p)
{
	struct ptarget *t = p->target;
	struct peer *q;

	snprintf(t->why, sizeof(t->why), "%s", p->why);
	t->p = NULL;
	t->t_next = now_s() + cfg->fabric_retry_s;
	p->target = NULL;
	/* Lost to the node's other connection as a duplicate: that one serves the imports
	 * that waited for this one. */
	if (p->node[0] != '\0' && (q = peer_by_node(p->node)) != NULL)
		peer_import_target_ready(t, q);
	else
		peer_import_target_down(t, p->why);
}

void
peer_dial_tick(double now)
{
	struct ptarget *t, *tt;

	TAILQ_FOREACH_SAFE(t, &targets, entry, tt) {
		bool up = t->p != NULL || t->resolving ||
		    (t->node[0] != '\0' && peer_by_node(t->node) != NULL);
		if (!t->on_demand && !up && now >= t->t_next)
			peer_dial(t);
		else if (t->on_demand && !up && !peer_import_waits_for(t)) {
			/* Gone, and no import asks for it: the next import by address dials again. */
			log_debug("fabric", "%s, dialled on demand, is forgotten%s%s", t->addr,
			    t->why[0] ? ": " : "", t->why);
			TAILQ_REMOVE(&targets, t, entry);
			free(t);
		}
	}
}

/* ---- start, stop, query ---- */

int
peer_dial_start(struct event_base *b)
{
	char host[80], port[16];

	base = b;
	if (cfg->fabric_listen != NULL) {
		struct addrinfo hints = { .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE }, *res;
		int e;
		if (!peer_dial_split(cfg->fabric_listen, host, sizeof(host), port, sizeof(port))) {
			log_warnx("fabric: listen = %s: not ADDR:PORT", cfg->fabric_listen);
			return -1;
		}
		if ((e = getaddrinfo(host, port, &hints, &res)) != 0) {
			log_warnx("fabric: listen = %s: %s", cfg->fabric_listen, gai_strerror(e));
			return -1;
		}
		listener = evconnlistener_new_bind(b, on_accept, NULL,
		    LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE | LEV_OPT_CLOSE_ON_EXEC, 64,
		    res->ai_addr, (int)res->ai_addrlen);
		freeaddrinfo(res);
		if (listener == NULL) {
			log_warn("fabric: listen on %s", cfg->fabric_listen);
			return -1;
		}
		snprintf(listen_addr, sizeof(listen_addr), "%s", cfg->fabric_listen);
	}
	for (const char *s = cfg->fabric_peers ? cfg->fabric_peers : ""; *s;) {
		size_t k = strcspn(s, ", ");
		if (k > 0) {
			struct ptarget *t = calloc(1, sizeof(*t));
			if (t == NULL || k >= sizeof(t->addr) ||
			    (snprintf(t->addr, sizeof(t->addr), "%.*s", (int)k, s),
			     !peer_dial_split(t->addr, host, sizeof(host), port, sizeof(port)))) {
				log_warnx("fabric: peers: '%.*s' is not HOST:PORT", (int)k, s);
				free(t);
				return -1;
			}
			TAILQ_INSERT_TAIL(&targets, t, entry);
		}
		s += k;
		s += strspn(s, ", ");
	}
	running = true;
	return 0;
}

/* After every peer is down. */
void
peer_dial_stop(void)
{
	struct ptarget *t;

	running = false;
	while ((t = TAILQ_FIRST(&targets)) != NULL) {
		if (t->resolving)
			break;      /* its resolve_done still refers to it: left to the exit */
		TAILQ_REMOVE(&targets, t, entry);
		free(t);
	}
	if (listener != NULL)
		evconnlistener_free(listener);
	listener = NULL;
}

const char *
peer_dial_listening(void)
{
	return listen_addr;
}

size_t
peer_dial_count(void)
{
	struct ptarget *t;
	size_t n = 0;

	TAILQ_FOREACH(t, &targets, entry)
		n++;
	return n;
}

/* Addresses with no connection now (configured, or dialled on demand and not forgotten yet):
 * why not.  q->peers has room for every address.  False if one could not be allocated. */
bool
peer_dial_query(Gpx__QueryReply *q)
{
	struct ptarget *t;

	TAILQ_FOREACH(t, &targets, entry) {
		if (t->p != NULL || (t->node[0] && peer_by_node(t->node) != NULL))
			continue;
		Gpx__PeerInfo *i = malloc(sizeof(*i));
		if (i == NULL)
			return false;
		gpx__peer_info__init(i);
		i->node = t->node;
		i->address = t->addr;
		i->state = t->resolving ? "connecting" : "down";
		i->transport = "tcp";
		i->outbound = true;
		i->why = t->why;
		i->on_demand = t->on_demand;
		q->peers[q->n_peers++] = i;
	}
	return true;
}
