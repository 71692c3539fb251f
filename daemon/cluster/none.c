/*
 * The cluster without libcurl: gpxd.conf's [cluster] is still checked, but a gpxd built
 * without libcurl cannot join one, and says so at start rather than running alone unawares.
 */
#include "config.h"

#include "daemon/gpxd.h"
#include "daemon/cluster/cluster.h"

int
cluster_start(struct event_base *b)
{
	(void)b;
	log_warnx("cluster: [cluster] etcd is set, but this gpxd was built without libcurl "
	    "(configure --with-curl)");
	return -1;
}

void
cluster_stop(void)
{
}

bool
cluster_running(void)
{
	return false;
}

void
cluster_name_add(const char *name, uid_t uid, cluster_done_fn done, void *arg)
{
	(void)name;
	(void)uid;
	done(arg, 0, NULL);
}

void
cluster_name_drop(const char *name)
{
	(void)name;
}

bool
cluster_import(struct fabric_import *rq)
{
	(void)rq;
	return false;
}

void
cluster_metrics(struct evbuffer *out)
{
	(void)out;
}

void
cluster_nodes_query(void (*done)(void *arg, int status, const char *why, char *json), void *arg)
{
	done(arg, 0, "", NULL);
}

void
cluster_stopping(void)
{
}

void
cluster_names_visit(void (*fn)(const char *name, const char *node, uid_t uid, void *arg), void *arg)
{
	(void)fn;
	(void)arg;
}

const char *
cluster_self(void)
{
	return "";
}

const char *
cluster_name_node(const char *name)
{
	(void)name;
	return NULL;
}
