/*
 * libgpxclient's introspection and administration: gpx_query (what gpxctl shows: the daemon's
 * status, clients, regions, exports, transfers, counters, peers), whose answer may come in a
 * memfd when it is larger than a message, and gpx_admin (drain, log level, reload).
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/stat.h>

#include "client-lib/client-private.h"

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
	if ((r = client_rpc(c, &m, NULL, 0, &rep, rfds, &rnfds)) < 0)
		return r;
	if (rep->query_in_fd) {
		struct stat st;
		if (rnfds != 1 || fstat(rfds[0], &st) < 0 || st.st_size <= 0 || st.st_size > (256 << 20)) {
			wire_close_fds(rfds, rnfds);
			return client_error(c, GPX_EPROTO, "bad query reply");
		}
		*len = st.st_size;
		*buf = malloc(*len);
		ssize_t got = *buf ? pread(rfds[0], *buf, *len, 0) : -1;
		close(rfds[0]);
		if (got != (ssize_t)*len) {
			free(*buf);
			return client_error(c, GPX_ESYS, "reading the query reply");
		}
		return 0;
	}
	wire_close_fds(rfds, rnfds);
	if (rep->body_case != GPX__REPLY__BODY_QUERY)
		return client_error(c, GPX_EPROTO, "unexpected reply to Query");
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
	if ((r = client_rpc(c, &m, NULL, 0, &rep, NULL, NULL)) < 0)
		return r;
	if (reply != NULL && replylen > 0)
		snprintf(reply, replylen, "%s", rep->message ? rep->message : "");
	return 0;
}
