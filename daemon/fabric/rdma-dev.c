/*
 * The RDMA devices of this gpxd.  Every device with an active port is opened (or those
 * [fabric] rdma_device names), each with its protection domain, completion queue and events:
 * the NICs of a node, its rails.  Memory is registered per device (rdma-mr.c).  Each device's
 * IP address, which the other side's rdma_cm needs to reach it, is found from the host's
 * interfaces, and one rdma_cm listener on the host of [fabric] listen (any address when there
 * are several devices) answers the peers' queue pairs (rdma-qp.c).
 *
 * A device's async events are watched here: a queue pair's error takes its peer down, a port
 * error or a device's fatal error every peer with a queue pair on it, and a port coming or
 * going makes the choice of each GPU's NIC again.  That choice comes from the topology in sysfs
 * (nic.c): a GPU's memory is registered only on its own NIC, and staged when that NIC is not
 * open here.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <sys/socket.h>
#include <event2/event.h>

#include "daemon/fabric/rdma.h"
#include "daemon/fabric/nic.h"

struct rdevs rdevs;

static void
nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);

	if (fl >= 0)
		fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

struct rdev *
rdev_of(const struct ibv_context *ctx)
{
	for (int i = 0; i < rdevs.n; i++)
		if (rdevs.d[i].ctx == ctx)
			return &rdevs.d[i];
	return NULL;
}

int
rdev_for(const struct region *r)
{
	if (r->host != NULL)
		return -1;
	return r->dev >= 0 && r->dev < GPX_MAX_GPUS ? rdevs.gpu_nic[r->dev] : -2;
}

/*
 * Each GPU's NIC among our devices (-2: none, or not open), from the topology in sysfs: at
 * start, and again when a port's state changes (the choice prefers active ports), not for
 * every chunk.  It logs the choices when asked to.
 */
static void
gpu_nics(bool say)
{
	for (int g = 0; g < GPX_MAX_GPUS; g++) {
		char want[64];
		enum nic_why w;
		rdevs.gpu_nic[g] = -2;
		if (g >= gpu_count() || !nic_for_dev(g, want, sizeof(want), &w))
			continue;
		for (int i = 0; i < rdevs.n; i++)
			if (strncmp(rdevs.d[i].name, want, strlen(want)) == 0 && rdevs.d[i].name[strlen(want)] == ' ')
				rdevs.gpu_nic[g] = i;
		if (say)
			log_info("fabric: GPU%d's memory goes through %s (%s)%s", g, want, nic_why_str(w),
			    rdevs.gpu_nic[g] >= 0 ? "" : ", which is not open: staged");
	}
}

/* ---- async events ---- */

/* Every peer with a queue pair on device d goes down (port or device error). */
static void
kill_all(const struct rdev *d, const char *why)
{
	struct peer *p, *t;

	TAILQ_FOREACH_SAFE(p, &peers, entry, t)
		for (int i = 0; p->rdma != NULL && i < RQP_MAX; i++)
			if (p->rdma->qp[i].id != NULL && p->rdma->qp[i].dev == d->index) {
				peer_kill(p, "rdma on %s: %s", d->name, why);
				break;
			}
}

static void
on_async(evutil_socket_t fd, short what, void *arg)
{
	struct rdev *d = arg;
	struct ibv_async_event ae;
	struct peer *p, *t;

	(void)fd;
	(void)what;
	while (ibv_get_async_event(d->ctx, &ae) == 0) {
		enum ibv_event_type type = ae.event_type;
		struct ibv_qp *qp = ae.element.qp;
		ibv_ack_async_event(&ae);
		switch (type) {
		case IBV_EVENT_QP_FATAL:
		case IBV_EVENT_QP_REQ_ERR:
		case IBV_EVENT_QP_ACCESS_ERR:
		case IBV_EVENT_PATH_MIG_ERR:
			TAILQ_FOREACH_SAFE(p, &peers, entry, t)
				for (int i = 0; p->rdma != NULL && i < RQP_MAX; i++)
					if (p->rdma->qp[i].id != NULL && p->rdma->qp[i].id->qp == qp) {
						peer_kill(p, "rdma queue pair %d: %s", i, ibv_event_type_str(type));
						break;
					}
			break;
		case IBV_EVENT_PORT_ERR:
		case IBV_EVENT_DEVICE_FATAL:
			log_warnx("fabric: %s: %s", d->name, ibv_event_type_str(type));
			kill_all(d, ibv_event_type_str(type));
			gpu_nics(false);
			break;
		case IBV_EVENT_PORT_ACTIVE:
			log_info("fabric: %s: port active", d->name);
			gpu_nics(false);
			break;
		default:
			log_debug("fabric", "%s: %s", d->name, ibv_event_type_str(type));
		}
	}
}

/* ---- start and stop ---- */

const char *
fabric_rdma_device(void)
{
	return rdevs.on ? rdevs.names : NULL;
}

/* Whether name is one of the comma-separated list. */
static bool
name_listed(const char *list, const char *name)
{
	size_t n = strlen(name);

	for (const char *p = list; *p != '\0'; p += strcspn(p, ",")) {
		p += strspn(p, ", ");
		if (strncmp(p, name, n) == 0 && (p[n] == '\0' || p[n] == ',' || p[n] == ' '))
			return true;
	}
	return false;
}

/* Every device with an active port (or those [fabric] rdma_device names, comma-separated). */
static bool
pick(char *why, size_t whylen)
{
	int n = 0;
	struct ibv_context **l = rdma_get_devices(&n);
	bool named = false;

	for (int i = 0; l != NULL && i < n && rdevs.n < FABRIC_RDMA_DEVS; i++) {
		const char *nm = ibv_get_device_name(l[i]->device);
		struct ibv_device_attr da;
		if (cfg->fabric_rdma_device != NULL && !name_listed(cfg->fabric_rdma_device, nm))
			continue;
		named = true;
		if (ibv_query_device(l[i], &da) != 0)
			continue;
		for (uint8_t pn = 1; pn <= da.phys_port_cnt; pn++) {
			struct ibv_port_attr pa;
			if (ibv_query_port(l[i], pn, &pa) == 0 && pa.state == IBV_PORT_ACTIVE) {
				struct rdev *d = &rdevs.d[rdevs.n];
				d->index = rdevs.n++;
				d->ctx = l[i];
				d->port_num = pn;
				d->max_cqe = da.max_cqe;
				d->rd_atom = (uint8_t)(da.max_qp_rd_atom < RQP_RD_ATOM ? da.max_qp_rd_atom : RQP_RD_ATOM);
				snprintf(d->name, sizeof(d->name), "%s port %u", nm, pn);
				break;
			}
		}
	}
	if (rdevs.n == 0)
		snprintf(why, whylen, "%s", n == 0 ? "no RDMA device" : cfg->fabric_rdma_device && !named ?
		    "rdma_device names no RDMA device" : "no RDMA device has an active port");
	if (l != NULL)
		rdma_free_devices(l);
	return rdevs.n > 0;
}

/*
 * The IP address of each device, which the connecting side's rdma_cm needs for the pairs of
 * devices: the first address of the host that rdma_cm binds to that device.
 */
static void
find_addrs(void)
{
	struct ifaddrs *ifs = NULL;

	if (getifaddrs(&ifs) < 0)
		return;
	for (struct ifaddrs *a = ifs; a != NULL; a = a->ifa_next) {
		struct rdma_cm_id *id;
		struct rdev *d;
		char host[64];
		if (a->ifa_addr == NULL || (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6) ||
		    (a->ifa_flags & IFF_LOOPBACK) || rdma_create_id(rdevs.ech, &id, NULL, RDMA_PS_TCP) < 0)
			continue;
		if (rdma_bind_addr(id, a->ifa_addr) == 0 && (d = rdev_of(id->verbs)) != NULL && d->addr[0] == '\0' &&
		    getnameinfo(a->ifa_addr, a->ifa_addr->sa_family == AF_INET ? sizeof(struct sockaddr_in) :
		    sizeof(struct sockaddr_in6), host, sizeof(host), NULL, 0, NI_NUMERICHOST) == 0 &&
		    strchr(host, '%') == NULL)
			snprintf(d->addr, sizeof(d->addr), "%s", host);
		rdma_destroy_id(id);
	}
	freeifaddrs(ifs);
}

/* The rdma_cm listener on the host of [fabric] listen, port chosen by the system. */
static void
listen_rdma(void)
{
	char host[80];
	const char *l = cfg->fabric_listen, *c;
	struct addrinfo hints = { .ai_flags = AI_PASSIVE }, *res = NULL;

	if (l == NULL || (c = strrchr(l, ':')) == NULL || (size_t)(c - l) >= sizeof(host))
		return;
	snprintf(host, sizeof(host), "%.*s", (int)(c - l), l);
	if (host[0] == '[' && host[strlen(host) - 1] == ']') {
		memmove(host, host + 1, strlen(host));
		host[strlen(host) - 1] = '\0';
	}
	/* A listener on one device's address would not hear the others: any address then. */
	if (rdevs.n > 1)
		host[0] = '\0';
	if (getaddrinfo(host[0] ? host : NULL, "0", &hints, &res) != 0 ||
	    rdma_create_id(rdevs.ech, &rdevs.listen_id, NULL, RDMA_PS_TCP) < 0) {
		log_warnx("fabric: no rdma listener on %s: peers connecting here use tcp", host);
		if (res != NULL)
			freeaddrinfo(res);
		rdevs.listen_id = NULL;
		return;
	}
	if (rdma_bind_addr(rdevs.listen_id, res->ai_addr) < 0 || rdma_listen(rdevs.listen_id, 16) < 0) {
		log_warn("fabric: rdma listener on %s (peers connecting here use tcp)", host);
		rdma_destroy_id(rdevs.listen_id);
		rdevs.listen_id = NULL;
	} else
		rdevs.port = ntohs(rdma_get_src_port(rdevs.listen_id));
	freeaddrinfo(res);
}

static int
rdev_open(struct event_base *b, struct rdev *d)
{
	if ((d->pd = ibv_alloc_pd(d->ctx)) == NULL || (d->cc = ibv_create_comp_channel(d->ctx)) == NULL ||
	    (d->cq = ibv_create_cq(d->ctx, d->max_cqe < CQ_DEPTH ? d->max_cqe : CQ_DEPTH, NULL, d->cc, 0)) == NULL ||
	    ibv_req_notify_cq(d->cq, 0) != 0)
		return -1;
	nonblock(d->cc->fd);
	nonblock(d->ctx->async_fd);
	d->cq_ev = event_new(b, d->cc->fd, EV_READ | EV_PERSIST, rdata_cq, d);
	d->async_ev = event_new(b, d->ctx->async_fd, EV_READ | EV_PERSIST, on_async, d);
	if (d->cq_ev == NULL || d->async_ev == NULL)
		return -1;
	event_add(d->cq_ev, NULL);
	event_add(d->async_ev, NULL);
	return 0;
}

int
fabric_rdma_init(struct event_base *b, char *why, size_t whylen)
{
	bool must = strcmp(cfg->fabric_transport, "rdma") == 0;

	if (strcmp(cfg->fabric_transport, "tcp") == 0) {
		snprintf(why, whylen, "tcp (configured)");
		return 0;
	}
	if (!pick(why, whylen))
		goto off;
	if ((rdevs.ech = rdma_create_event_channel()) == NULL) {
		snprintf(why, whylen, "rdma_cm: %s", strerror(errno));
		fabric_rdma_shutdown();
		goto off;
	}
	for (int i = 0; i < rdevs.n; i++)
		if (rdev_open(b, &rdevs.d[i]) < 0) {
			snprintf(why, whylen, "%s: setting up: %s", rdevs.d[i].name, strerror(errno));
			fabric_rdma_shutdown();
			goto off;
		}
	nonblock(rdevs.ech->fd);
	rqp_release_start();
	if ((rdevs.cm_ev = event_new(b, rdevs.ech->fd, EV_READ | EV_PERSIST, rqp_cm, NULL)) == NULL) {
		snprintf(why, whylen, "out of memory");
		fabric_rdma_shutdown();
		goto off;
	}
	event_add(rdevs.cm_ev, NULL);
	rdevs.on = true;
	find_addrs();
	for (int i = 0; i < rdevs.n; i++) {
		size_t k = strlen(rdevs.names);
		snprintf(rdevs.names + k, sizeof(rdevs.names) - k, "%s%s", k ? ", " : "", rdevs.d[i].name);
		log_info("fabric: rdma device %d: %s, address %s", i, rdevs.d[i].name,
		    rdevs.d[i].addr[0] ? rdevs.d[i].addr : "none (reached only as the control connection's)");
	}
	listen_rdma();
	gpu_nics(true);
	if (rdevs.port)
		snprintf(why, whylen, "rdma on %s, rdma_cm port %u", rdevs.names, rdevs.port);
	else
		snprintf(why, whylen, "rdma on %s (outbound only)", rdevs.names);
	return 1;
off:
	if (must)
		return -1;
	snprintf(why + strlen(why), whylen - strlen(why), ": tcp");
	return 0;
}

/* After every peer is down. */
void
fabric_rdma_shutdown(void)
{
	rmr_shutdown();
	if (rdevs.cm_ev != NULL)
		event_free(rdevs.cm_ev);
	for (int i = 0; i < rdevs.n; i++) {
		if (rdevs.d[i].cq_ev != NULL)
			event_free(rdevs.d[i].cq_ev);
		if (rdevs.d[i].async_ev != NULL)
			event_free(rdevs.d[i].async_ev);
	}
	if (rdevs.listen_id != NULL)
		rdma_destroy_id(rdevs.listen_id);
	/* Ids still being let go of need the channel and their devices: the process ends with them. */
	if (rqp_release_stop(2.0)) {
		if (rdevs.ech != NULL)
			rdma_destroy_event_channel(rdevs.ech);
		for (int i = 0; i < rdevs.n; i++) {
			struct rdev *d = &rdevs.d[i];
			if (d->cq != NULL)
				ibv_destroy_cq(d->cq);
			if (d->cc != NULL)
				ibv_destroy_comp_channel(d->cc);
			if (d->pd != NULL)
				ibv_dealloc_pd(d->pd);
		}
	}
	memset(&rdevs, 0, sizeof(rdevs));
}

