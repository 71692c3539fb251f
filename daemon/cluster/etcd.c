/*
 * etcd's v3 API through its JSON gateway (HTTP/1.1 POSTs of JSON to /v3/..., keys and values
 * in base64), on the daemon's event loop.  HTTP is libcurl's multi interface driven by
 * libevent (curl_multi_socket_action: curl tells which sockets and timeouts to watch, the
 * loop tells curl what happened), so no call blocks the loop and TLS, proxies, redirects and
 * HTTP's corner cases are curl's, a library every distribution keeps patched.  JSON is json-c,
 * which gpxctl already uses; its incremental tokener splits the watch's stream of objects.
 *
 * Endpoints: [cluster] etcd lists one or more; calls go to one, and a call that cannot reach
 * it moves the next calls to the following one.
 *
 * etcd's own authentication ([cluster] auth_file): a token from /v3/auth/authenticate goes
 * with every call.  etcd forgets a token (a simple token after --auth-token-ttl seconds
 * without use, every token when it restarts; lease keep-alives do not count as use): a call
 * answered "invalid auth token" waits while a new token is asked for, then goes again, once.
 * TLS ([cluster] cacert, cert, key) is curl's; a handshake that fails is said in words that
 * name the file to look at.
 */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <curl/curl.h>
#include <event2/event.h>

#include "daemon/cluster/internal.h"

#define REPLY_MAX (256u << 20)       /* a range of a large cluster's names */
#define MSG_MAX (16u << 20)          /* one object of a stream */

struct etcd_call {
	TAILQ_ENTRY(etcd_call) entry;
	CURL *h;
	struct curl_slist *hdrs;
	char *body;
	char *buf;                   /* the reply (streams: none) */
	size_t len, cap;             /* streams: len, the bytes of the object being parsed */
	json_tokener *tok;           /* streams only */
	etcd_msg_fn msg;
	etcd_fn done;
	void *arg;
	double t0;
	char err[CURL_ERROR_SIZE];
	bool failed_parse;
	bool nomem;                  /* the reply found no memory here */
	bool cancelled;              /* cancelled inside curl's callbacks: freed once curl returns */
	bool no_token;               /* the authentication itself */
	bool again;                  /* sent again with a new token already */
	bool waiting;                /* out of curl, waiting for a new token */
	bool doomed;                 /* in flight when curl found no memory: fails */
};

static TAILQ_HEAD(, etcd_call) calls = TAILQ_HEAD_INITIALIZER(calls);
static struct event_base *base;
static CURLM *multi;
static struct event *timer_ev;
static struct event *reap_ev;            /* frees calls cancelled inside curl's callbacks */
static int in_curl;                      /* curl_multi_socket_action runs: no handle may go */
static char **urls;
static size_t nurls, cur;
static char *token;
static char *cacert, *cert, *key;
static char *auth_user, *auth_pass;      /* [cluster] auth_file; NULL: etcd's auth is off */
static struct etcd_call *reauth_call;    /* a new token asked for, calls waiting for it */
struct etcd_stats etcd_stats;

/* ---- base64 and JSON helpers ---- */

static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

char *
b64_enc(const void *in, size_t n)
{
	const unsigned char *p = in;
	char *out = malloc(4 * ((n + 2) / 3) + 1), *o = out;

	if (out == NULL)
		return NULL;
	for (size_t i = 0; i < n; i += 3) {
		uint32_t v = p[i] << 16 | (i + 1 < n ? p[i + 1] << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
		*o++ = b64[v >> 18];
		*o++ = b64[v >> 12 & 63];
		*o++ = i + 1 < n ? b64[v >> 6 & 63] : '=';
		*o++ = i + 2 < n ? b64[v & 63] : '=';
	}
	*o = '\0';
	return out;
}

char *
b64_dec(const char *s, size_t *len)
{
	size_t n = strlen(s), k = 0;
	uint32_t v = 0;
	int bits = 0;
	char *out;

	if (n % 4 != 0) {
		errno = EINVAL;
		return NULL;
	}
	if ((out = malloc(n / 4 * 3 + 1)) == NULL)
		return NULL;
	for (size_t i = 0; i < n; i++) {
		const char *c = strchr(b64, s[i]);
		if (s[i] == '=') {
			if (i < n - 2 || (i == n - 2 && s[n - 1] != '='))
				goto bad;
			break;
		}
		if (c == NULL || s[i] == '\0')
			goto bad;
		v = v << 6 | (uint32_t)(c - b64);
		if ((bits += 6) >= 8) {
			bits -= 8;
			out[k++] = (char)(v >> bits);
		}
	}
	out[k] = '\0';
	*len = k;
	return out;
bad:
	free(out);
	errno = EINVAL;
	return NULL;
}

const char *
js_str(struct json_object *o, const char *k)
{
	struct json_object *v;

	if (o == NULL || !json_object_object_get_ex(o, k, &v) || !json_object_is_type(v, json_type_string))
		return NULL;
	return json_object_get_string(v);
}

int64_t
js_int(struct json_object *o, const char *k)
{
	struct json_object *v;

	if (o == NULL || !json_object_object_get_ex(o, k, &v))
		return 0;
	if (json_object_is_type(v, json_type_string))
		return strtoll(json_object_get_string(v), NULL, 10);
	return json_object_get_int64(v);
}

struct json_object *
js_parse(const char *s, bool *nomem)
{
	json_tokener *t = json_tokener_new();
	struct json_object *o = NULL;

	*nomem = t == NULL;
	if (t == NULL)
		return NULL;
	o = json_tokener_parse_ex(t, s, -1);
	if (json_tokener_get_error(t) != json_tokener_success) {
		json_object_put(o);
		o = NULL;
	}
	json_tokener_free(t);
	return o;
}

char *
js_text(struct json_object *o)
{
	const char *t = o != NULL ? json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN) : NULL;
	bool nomem;
	struct json_object *back = t != NULL ? js_parse(t, &nomem) : NULL;
	char *s = back != NULL && json_object_equal(back, o) ? strdup(t) : NULL;

	json_object_put(back);
	return s;
}

bool
js_add(struct json_object *o, const char *name, struct json_object *v)
{
	if (o == NULL || v == NULL || json_object_object_add(o, name, v) < 0) {
		json_object_put(v);
		return false;
	}
	return true;
}

bool
js_push(struct json_object *a, struct json_object *v)
{
	if (a == NULL || v == NULL || json_object_array_add(a, v) < 0) {
		json_object_put(v);
		return false;
	}
	return true;
}

/* ---- curl on the loop ---- */

static void check_done(void);
static void reap_cb(evutil_socket_t, short, void *);
static void call_free(struct etcd_call *);

static bool
is_doomed(const struct etcd_call *k)
{
	return k->doomed;
}

static bool
is_waiting(const struct etcd_call *k)
{
	return k->waiting;
}

/*
 * Every call which(k) holds for ends with err and why.  Each done may cancel or make others,
 * so the next is looked for from the start each time.
 */
static void
fail_calls(bool (*which)(const struct etcd_call *), int err, const char *why)
{
	struct etcd_call *k;

	for (;;) {
		TAILQ_FOREACH(k, &calls, entry)
			if (which(k))
				break;
		if (k == NULL)
			return;
		etcd_fn done = k->done;
		void *darg = k->arg;
		call_free(k);
		done(darg, err, NULL, why);
	}
}

/*
 * curl found no memory for its own state (a socket it was to watch, a timer): which transfer
 * it left unwatched, waiting for ever, it does not say.  Every call in flight then ends, out
 * of memory (not those their ends make).  All leave curl first: curl takes no new call while
 * one is left after a callback refused (a socket's event found no memory).
 */
static void
curl_failed(CURLMcode rc)
{
	struct etcd_call *k;

	log_warnx("cluster: curl: %s: every call to etcd in flight fails", curl_multi_strerror(rc));
	TAILQ_FOREACH(k, &calls, entry)
		if ((k->doomed = !k->cancelled && !k->waiting))
			curl_multi_remove_handle(multi, k->h);
	fail_calls(is_doomed, ETCD_NOMEM, "out of memory");
}

/* curl told what happened on the loop: the calls it ended are answered. */
static void
curl_act(curl_socket_t fd, int fl)
{
	int running;
	CURLMcode rc;

	in_curl++;
	rc = curl_multi_socket_action(multi, fd, fl, &running);
	in_curl--;
	check_done();
	if (rc != CURLM_OK)
		curl_failed(rc);
}

static void
on_sock(evutil_socket_t fd, short what, void *arg)
{
	(void)arg;
	curl_act(fd, (what & EV_READ ? CURL_CSELECT_IN : 0) | (what & EV_WRITE ? CURL_CSELECT_OUT : 0));
}

static void
on_timer(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	(void)arg;
	curl_act(CURL_SOCKET_TIMEOUT, 0);
}

static int
sock_cb(CURL *e, curl_socket_t s, int what, void *userp, void *socketp)
{
	struct event *ev = socketp;

	(void)e;
	(void)userp;
	if (what == CURL_POLL_REMOVE) {
		if (ev != NULL)
			event_free(ev);
		curl_multi_assign(multi, s, NULL);
		return 0;
	}
	short kind = (what & CURL_POLL_IN ? EV_READ : 0) | (what & CURL_POLL_OUT ? EV_WRITE : 0) | EV_PERSIST;
	if (ev != NULL) {
		event_del(ev);
		event_assign(ev, base, s, kind, on_sock, NULL);
	} else {
		if ((ev = event_new(base, s, kind, on_sock, NULL)) == NULL)
			return -1;
		curl_multi_assign(multi, s, ev);
	}
	event_add(ev, NULL);
	return 0;
}

static int
timer_cb(CURLM *m, long ms, void *userp)
{
	struct timeval tv = { ms / 1000, (ms % 1000) * 1000 };

	(void)m;
	(void)userp;
	if (ms < 0)
		evtimer_del(timer_ev);
	else
		evtimer_add(timer_ev, &tv);
	return 0;
}

/* ---- calls ---- */

static void
call_free(struct etcd_call *k)
{
	TAILQ_REMOVE(&calls, k, entry);
	curl_multi_remove_handle(multi, k->h);
	curl_easy_cleanup(k->h);
	curl_slist_free_all(k->hdrs);
	if (k->tok != NULL)
		json_tokener_free(k->tok);
	free(k->body);
	free(k->buf);
	free(k);
}

/*
 * A stream's bytes, fed to the tokener as they come (it keeps its state between chunks, so an
 * object is parsed once however many chunks carry it): every complete object goes to msg.
 */
static bool
stream_feed(struct etcd_call *k, const char *p, size_t len)
{
	size_t off = 0;

	while (off < len && !k->cancelled) {
		if (k->len == 0) {
			while (off < len && strchr(" \t\r\n", p[off]) != NULL)
				off++;
			if (off == len)
				break;
		}
		size_t n = len - off > INT32_MAX ? INT32_MAX : len - off;
		struct json_object *o = json_tokener_parse_ex(k->tok, p + off, (int)n);
		enum json_tokener_error e = json_tokener_get_error(k->tok);
		if (o == NULL && e == json_tokener_continue) {
			k->len += n;         /* the object so far: bounded */
			return k->len <= MSG_MAX;
		}
		if (o == NULL)
			return false;
		off += json_tokener_get_parse_end(k->tok);
		json_tokener_reset(k->tok);
		k->len = 0;
		k->msg(k->arg, o);
		json_object_put(o);
	}
	return true;
}

static size_t
on_data(char *p, size_t sz, size_t n, void *arg)
{
	struct etcd_call *k = arg;
	size_t len = sz * n;

	if (k->cancelled)
		return 0;
	if (k->msg != NULL) {
		if (!stream_feed(k, p, len)) {
			k->failed_parse = true;
			return 0;
		}
		return k->cancelled ? 0 : len;
	}
	if (k->len + len > REPLY_MAX)
		return 0;
	if (k->len + len + 1 > k->cap) {
		size_t cap = (k->len + len + 1) * 2;
		char *b = realloc(k->buf, cap);
		if (b == NULL) {
			k->nomem = true;
			return 0;
		}
		k->buf = b;
		k->cap = cap;
	}
	memcpy(k->buf + k->len, p, len);
	k->len += len;
	k->buf[k->len] = '\0';
	return len;
}

/* The error etcd (or its gateway) put in a reply: "error" or "message". */
static const char *
reply_error(struct json_object *o)
{
	struct json_object *e;
	const char *s;

	if (json_object_object_get_ex(o, "error", &e) && json_object_is_type(e, json_type_object))
		o = e;
	if ((s = js_str(o, "message")) != NULL || (s = js_str(o, "error")) != NULL)
		return s;
	return NULL;
}

/*
 * Why a call got no HTTP answer, in words an operator can act on: a TLS connection that
 * failed names the [cluster] file to look at.  curl says which side refused: its own
 * verification of etcd's certificate, its reading of our files, or etcd.  etcd refuses a
 * client certificate (or its absence) with an alert; under TLS 1.3 that comes after our side
 * of the handshake is done, so curl may see only the connection closed under its request.
 */
static void
unreached_why(const struct etcd_call *k, CURLcode rc, char *why, size_t len)
{
	const char *e = k->err[0] ? k->err : curl_easy_strerror(rc);
	bool alert = strstr(e, "alert") != NULL && (strstr(e, "certificate") != NULL || strstr(e, "unknown ca") != NULL);
	curl_off_t tls_done = 0;

	curl_easy_getinfo(k->h, CURLINFO_APPCONNECT_TIME_T, &tls_done);
	bool closed = tls_done > 0 && (rc == CURLE_SEND_ERROR || rc == CURLE_RECV_ERROR || rc == CURLE_GOT_NOTHING);
	if (rc == CURLE_PEER_FAILED_VERIFICATION)
		snprintf(why, len, "%s: TLS verification of etcd's certificate failed (cacert %s): %s", urls[cur],
		    cacert ? cacert : "unset: the system's CAs", e);
	else if (rc == CURLE_SSL_CACERT_BADFILE)
		snprintf(why, len, "%s: TLS: cacert %s cannot be used: %s", urls[cur], cacert ? cacert : "(system)", e);
	else if (rc == CURLE_SSL_CERTPROBLEM)
		snprintf(why, len, "%s: TLS: client certificate %s (key %s) cannot be used: %s", urls[cur],
		    cert ? cert : "-", key ? key : cert ? cert : "-", e);
	else if ((alert || closed) && cert == NULL)
		snprintf(why, len, "%s: etcd refused the TLS connection: it asks for a client certificate, "
		    "and [cluster] cert is not set (%s)", urls[cur], e);
	else if (alert || closed)
		snprintf(why, len, "%s: etcd refused the TLS connection with client certificate %s (%s)", urls[cur],
		    cert, e);
	else
		snprintf(why, len, "%s: %s", urls[cur], e);
}

static void reauth(void);
static void auth_answer(int *err, struct json_object *r, char *why, size_t len);

/* A reply that is no JSON of etcd's (a proxy's page, a plain-text refusal), printable. */
static const char *
body_text(const struct etcd_call *k, char *out, size_t len)
{
	size_t n = 0;

	for (size_t i = 0; k->buf != NULL && i < k->len && n + 1 < len; i++)
		out[n++] = k->buf[i] >= ' ' && k->buf[i] <= '~' ? k->buf[i] : ' ';
	while (n > 0 && out[n - 1] == ' ')
		n--;
	out[n] = '\0';
	return n > 0 ? out : "no text";
}

static void
finish(struct etcd_call *k, CURLcode rc)
{
	long status = 0;
	struct json_object *o = NULL;
	char why[400];
	int err = 0;

	if (k->cancelled) {
		call_free(k);
		return;
	}
	curl_easy_getinfo(k->h, CURLINFO_RESPONSE_CODE, &status);
	/* 401: etcd no longer knows our token (grpc Unauthenticated): a new one, and again. */
	if (status == 401 && k->msg == NULL && auth_user != NULL && !k->no_token && !k->again) {
		curl_multi_remove_handle(multi, k->h);
		k->again = k->waiting = true;
		k->len = 0;
		reauth();
		return;
	}
	if (k->nomem || rc == CURLE_OUT_OF_MEMORY) {
		snprintf(why, sizeof(why), "out of memory");
		err = ETCD_NOMEM;
	} else if (rc != CURLE_OK && (k->msg == NULL || status == 0 || k->failed_parse)) {
		if (k->failed_parse)
			snprintf(why, sizeof(why), "%s: malformed stream", urls[cur]);
		else if (status == 0)
			unreached_why(k, rc, why, sizeof(why));
		else
			snprintf(why, sizeof(why), "%s: %s", urls[cur], k->err[0] ? k->err : curl_easy_strerror(rc));
		err = status != 0 ? ETCD_REFUSED : rc == CURLE_OPERATION_TIMEDOUT ? ETCD_TIMEDOUT : ETCD_UNREACHABLE;
		if (status == 0) {
			etcd_stats.failures++;
			cur = (cur + 1) % nurls;     /* the next call tries the next endpoint */
		}
	} else if (k->msg != NULL) {
		snprintf(why, sizeof(why), "%s: the stream ended%s%s", urls[cur], rc ? ": " : "",
		    rc ? curl_easy_strerror(rc) : "");
		err = -1;
	} else {
		double t = now_s() - k->t0;
		etcd_stats.rtt_sum += t;
		etcd_stats.rtt_n++;
		etcd_stats.rtt_last = t;
		bool nomem = false;
		o = k->buf ? js_parse(k->buf, &nomem) : NULL;
		if (nomem) {
			snprintf(why, sizeof(why), "out of memory");
			err = ETCD_NOMEM;
		} else if (status != 200 || o == NULL) {
			const char *m = o ? reply_error(o) : NULL;
			char text[160];
			/* etcd's auth is on, and we have no credentials for it */
			bool anon = auth_user == NULL && m != NULL && strstr(m, "user name is empty") != NULL;
			snprintf(why, sizeof(why), "etcd answered %ld: %s%s", status, m ? m : body_text(k, text, sizeof(text)),
			    anon ? " (etcd's authentication is on: [cluster] auth_file names a user)" : "");
			err = -2;
		} else
			why[0] = '\0';
	}
	if (k->no_token)
		auth_answer(&err, o, why, sizeof(why));
	etcd_fn done = k->done;
	void *arg = k->arg;
	call_free(k);
	done(arg, err, o, why);
	if (o != NULL)
		json_object_put(o);
}

static void
check_done(void)
{
	CURLMsg *m;
	int left;

	while ((m = curl_multi_info_read(multi, &left)) != NULL) {
		struct etcd_call *k;
		if (m->msg != CURLMSG_DONE)
			continue;
		curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&k);
		finish(k, m->data.result);
	}
}

/* The call's headers, with the token now held: false when a list of them found no memory. */
static bool
call_headers(struct etcd_call *k)
{
	struct curl_slist *l;
	char auth[600];

	curl_slist_free_all(k->hdrs);
	k->hdrs = curl_slist_append(NULL, "Content-Type: application/json");
	if (k->hdrs != NULL && token != NULL && !k->no_token) {
		snprintf(auth, sizeof(auth), "Authorization: %s", token);
		if ((l = curl_slist_append(k->hdrs, auth)) == NULL) {
			curl_slist_free_all(k->hdrs);
			k->hdrs = NULL;
		} else
			k->hdrs = l;
	}
	curl_easy_setopt(k->h, CURLOPT_HTTPHEADER, k->hdrs);
	return k->hdrs != NULL;
}

/* A call of path with body (taken over), not started yet; NULL when an allocation failed. */
static struct etcd_call *
call_new(const char *path, struct json_object *body, double timeout, etcd_fn done, void *arg)
{
	struct etcd_call *k = calloc(1, sizeof(*k));
	char url[512];

	if (k != NULL)
		k->body = js_text(body);
	json_object_put(body);
	if (k == NULL || k->body == NULL || (k->h = curl_easy_init()) == NULL) {
		if (k != NULL)
			free(k->body);
		free(k);
		return NULL;
	}
	k->done = done;
	k->arg = arg;
	k->t0 = now_s();
	snprintf(url, sizeof(url), "%s%s", urls[cur], path);
	/* (curl copies the URL and the files' names: each may find no memory) */
	if (!call_headers(k) || curl_easy_setopt(k->h, CURLOPT_URL, url) != CURLE_OK ||
	    (cacert != NULL && curl_easy_setopt(k->h, CURLOPT_CAINFO, cacert) != CURLE_OK) ||
	    (cert != NULL && curl_easy_setopt(k->h, CURLOPT_SSLCERT, cert) != CURLE_OK) ||
	    (key != NULL && curl_easy_setopt(k->h, CURLOPT_SSLKEY, key) != CURLE_OK) ||
	    curl_easy_setopt(k->h, CURLOPT_PROTOCOLS_STR, "http,https") != CURLE_OK) {
		curl_easy_cleanup(k->h);
		curl_slist_free_all(k->hdrs);
		free(k->body);
		free(k);
		return NULL;
	}
	curl_easy_setopt(k->h, CURLOPT_POSTFIELDS, k->body);
	curl_easy_setopt(k->h, CURLOPT_WRITEFUNCTION, on_data);
	curl_easy_setopt(k->h, CURLOPT_WRITEDATA, k);
	curl_easy_setopt(k->h, CURLOPT_PRIVATE, k);
	curl_easy_setopt(k->h, CURLOPT_ERRORBUFFER, k->err);
	curl_easy_setopt(k->h, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(k->h, CURLOPT_CONNECTTIMEOUT_MS, 2000L);
	/* HTTP/1.1 over https as over http (ALPN would pick HTTP/2 of etcd's Go server) */
	curl_easy_setopt(k->h, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
	if (timeout > 0)
		curl_easy_setopt(k->h, CURLOPT_TIMEOUT_MS, (long)(timeout * 1000));
	TAILQ_INSERT_TAIL(&calls, k, entry);
	etcd_stats.calls++;
	return k;
}

/* Starts k on the next turn of the loop, so that done never runs before the caller returns. */
static struct etcd_call *
call_go(struct etcd_call *k)
{
	if (k != NULL && curl_multi_add_handle(multi, k->h) != CURLM_OK) {
		TAILQ_REMOVE(&calls, k, entry);
		curl_easy_cleanup(k->h);
		curl_slist_free_all(k->hdrs);
		free(k->body);
		free(k);
		return NULL;
	}
	return k;
}

struct etcd_call *
etcd_post(const char *path, struct json_object *body, double timeout, etcd_fn done, void *arg)
{
	return call_go(call_new(path, body, timeout, done, arg));
}

struct etcd_call *
etcd_stream(const char *path, struct json_object *body, etcd_msg_fn msg, etcd_fn done, void *arg)
{
	struct etcd_call *k = call_new(path, body, 0, done, arg);

	if (k == NULL)
		return NULL;
	k->msg = msg;
	if ((k->tok = json_tokener_new()) == NULL) {
		k->msg = NULL;
		call_free(k);
		return NULL;
	}
	/* Nothing but the watch's events comes on it: a dead etcd shows as a connection gone,
	 * or as keep-alives of TCP left unanswered. */
	curl_easy_setopt(k->h, CURLOPT_TCP_KEEPALIVE, 1L);
	curl_easy_setopt(k->h, CURLOPT_TCP_KEEPIDLE, 2L);
	curl_easy_setopt(k->h, CURLOPT_TCP_KEEPINTVL, 1L);
	return call_go(k);
}

/* ---- etcd's own authentication ---- */

/* etcd's auth token for the calls from now on. */
static void
token_set(const char *t)
{
	free(token);
	token = t ? strdup(t) : NULL;
}

/* The answer to /v3/auth/authenticate: its token held from now on, or why not, naming the user. */
static void
auth_answer(int *err, struct json_object *r, char *why, size_t len)
{
	const char *t = *err == 0 ? js_str(r, "token") : NULL;
	char was[400];

	if (*err == 0 && (t == NULL || t[0] == '\0' || strlen(t) > 512 ||
	    strspn(t, "!#$%&'*+-./0123456789:=?@ABCDEFGHIJKLMNOPQRSTUVWXYZ^_`abcdefghijklmnopqrstuvwxyz|~") != strlen(t))) {
		*err = ETCD_REFUSED;
		snprintf(why, len, "no token, or a token that is no header value, in the answer");
	}
	if (*err == 0) {
		token_set(t);
		return;
	}
	snprintf(was, sizeof(was), "%s", why);
	snprintf(why, len, "etcd authentication as %.64s failed: %.300s", auth_user, was);
}

struct etcd_call *
etcd_authenticate(etcd_fn done, void *arg)
{
	struct json_object *b = json_object_new_object();
	struct etcd_call *k;

	if (!js_add(b, "name", json_object_new_string(auth_user ? auth_user : "")) ||
	    !js_add(b, "password", json_object_new_string(auth_pass ? auth_pass : ""))) {
		json_object_put(b);
		b = NULL;
	}
	if ((k = call_new("/v3/auth/authenticate", b, 5, done, arg)) == NULL)
		return NULL;
	k->no_token = true;            /* etcd refuses a stale token even here */
	if (!call_headers(k)) {
		call_free(k);
		return NULL;
	}
	return call_go(k);
}

/* The new token came (the calls that waited for it go again) or did not (they fail). */
static void
on_reauth(void *arg, int err, struct json_object *r, const char *why)
{
	struct etcd_call *k;

	(void)arg;
	(void)r;
	reauth_call = NULL;
	if (err == 0) {
		bool stuck = false;
		TAILQ_FOREACH(k, &calls, entry) {
			if (!k->waiting)
				continue;
			k->t0 = now_s();
			k->err[0] = '\0';
			if (call_headers(k) && curl_multi_add_handle(multi, k->h) == CURLM_OK)
				k->waiting = false;
			else
				stuck = true;   /* failed below */
		}
		if (!stuck)
			return;
		why = "out of memory";
		err = ETCD_UNREACHABLE;
	}
	log_warnx("cluster: %s", why);
	fail_calls(is_waiting, err, why);
}

static void
reauth(void)
{
	if (reauth_call != NULL)
		return;
	log_info("cluster: etcd no longer knows this node's auth token: authenticating again as %s", auth_user);
	if ((reauth_call = etcd_authenticate(on_reauth, NULL)) == NULL)
		on_reauth(NULL, ETCD_UNREACHABLE, NULL, "out of memory");
}

const char *
etcd_auth_user(void)
{
	return auth_user;
}

/* "user:password" from [cluster] auth_file, which others must not read. */
static int
auth_load(const char *path, char *why, size_t whylen)
{
	char buf[512], *colon;
	FILE *f = fopen(path, "re");
	struct stat st;

	if (f == NULL) {
		snprintf(why, whylen, "auth_file %s: %s", path, strerror(errno));
		return -1;
	}
	if (fstat(fileno(f), &st) == 0 && (st.st_mode & 077) != 0) {
		snprintf(why, whylen, "auth_file %s may be read by others: chmod 600 it", path);
		fclose(f);
		return -1;
	}
	if (fgets(buf, sizeof(buf), f) == NULL || (colon = strchr(buf, ':')) == NULL || colon == buf) {
		snprintf(why, whylen, "auth_file %s: one line, USER:PASSWORD", path);
		fclose(f);
		return -1;
	}
	fclose(f);
	buf[strcspn(buf, "\r\n")] = '\0';
	*colon = '\0';
	auth_user = strdup(buf);
	auth_pass = strdup(colon + 1);
	explicit_bzero(buf, sizeof(buf));
	if (auth_user == NULL || auth_pass == NULL) {
		snprintf(why, whylen, "auth_file %s: out of memory", path);
		return -1;
	}
	return 0;
}

void
etcd_cancel(struct etcd_call *k)
{
	if (k == NULL)
		return;
	/* curl forbids removing a handle from within its callbacks (a watch's message may
	 * cancel the others): it goes once curl has returned. */
	if (in_curl > 0) {
		k->cancelled = true;
		event_active(reap_ev, 0, 0);
	} else
		call_free(k);
}

static void
reap_cb(evutil_socket_t fd, short what, void *arg)
{
	struct etcd_call *k, *t;

	(void)fd;
	(void)what;
	(void)arg;
	TAILQ_FOREACH_SAFE(k, &calls, entry, t)
		if (k->cancelled)
			call_free(k);
}

const char *
etcd_endpoint(void)
{
	return nurls ? urls[cur] : "";
}

static char *
dup_or_null(const char *s)
{
	return s ? strdup(s) : NULL;
}

int
etcd_init(struct event_base *b, const struct cluster_conf *cc, char *why, size_t whylen)
{
	CURLcode code;

	base = b;
	if (cc->auth_file != NULL && auth_load(cc->auth_file, why, whylen) < 0)
		return -1;
	if ((code = curl_global_init(CURL_GLOBAL_DEFAULT)) != CURLE_OK) {
		snprintf(why, whylen, "libcurl cannot start: %s",
		    code == CURLE_OUT_OF_MEMORY ? "out of memory" : curl_easy_strerror(code));
		return -1;
	}
	/* (curl_multi_init fails only for want of memory) */
	if ((multi = curl_multi_init()) == NULL) {
		snprintf(why, whylen, "libcurl cannot start: out of memory");
		curl_global_cleanup();
		return -1;
	}
	for (const char *s = cc->etcd; *s;) {
		size_t k = strcspn(s, ", ");
		if (k > 0) {
			char **u = realloc(urls, (nurls + 1) * sizeof(*u));
			if (u == NULL)
				goto nomem;
			urls = u;
			/* "http://h:p/" and "http://h:p" are one endpoint: paths start with '/' */
			while (k > 0 && s[k - 1] == '/')
				k--;
			if ((urls[nurls] = strndup(s, k)) == NULL)
				goto nomem;
			nurls++;
		}
		s += strcspn(s, ", ");
		s += strspn(s, ", ");
	}
	/* A TLS file's name lost to want of memory would mean talking to etcd without it. */
	cacert = dup_or_null(cc->cacert);
	cert = dup_or_null(cc->cert);
	key = dup_or_null(cc->key);
	if ((cc->cacert != NULL && cacert == NULL) || (cc->cert != NULL && cert == NULL) ||
	    (cc->key != NULL && key == NULL) || (timer_ev = evtimer_new(base, on_timer, NULL)) == NULL ||
	    (reap_ev = event_new(base, -1, 0, reap_cb, NULL)) == NULL)
		goto nomem;
	curl_multi_setopt(multi, CURLMOPT_SOCKETFUNCTION, sock_cb);
	curl_multi_setopt(multi, CURLMOPT_TIMERFUNCTION, timer_cb);
	return 0;
nomem:
	snprintf(why, whylen, "out of memory starting the etcd client");
	etcd_shutdown();
	return -1;
}

void
etcd_shutdown(void)
{
	struct etcd_call *k;

	if (multi == NULL)
		return;
	while ((k = TAILQ_FIRST(&calls)) != NULL)
		call_free(k);
	curl_multi_cleanup(multi);
	multi = NULL;
	if (timer_ev != NULL)
		event_free(timer_ev);
	if (reap_ev != NULL)
		event_free(reap_ev);
	timer_ev = reap_ev = NULL;
	for (size_t i = 0; i < nurls; i++)
		free(urls[i]);
	free(urls);
	urls = NULL;
	nurls = 0;
	free(token);
	free(cacert);
	free(cert);
	free(key);
	token = cacert = cert = key = NULL;
	reauth_call = NULL;
	free(auth_user);
	if (auth_pass != NULL)
		explicit_bzero(auth_pass, strlen(auth_pass));
	free(auth_pass);
	auth_user = auth_pass = NULL;
	curl_global_cleanup();
}
