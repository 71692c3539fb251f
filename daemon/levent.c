/*
 * All libevent glue: the listening socket (ours or systemd's), per-connection read events and
 * pidfd exit events, signals (TERM/INT stop, HUP reloads), the watchdog and status timers, the
 * reaper of dead connections and the graceful shutdown that lets in-flight transfers end with
 * a "shutting down" status before the daemon exits.
 *
 * Descriptors.  At start gpxd raises its soft RLIMIT_NOFILE to the hard limit.  It keeps
 * reserved_fds descriptors open on /dev/null that nothing else can take (spare[]).  When
 * accept(2) fails with EMFILE they are closed, and until all of them can be held again (tried
 * every second) the daemon is short: it admits only root and the admin group, with the
 * descriptors the spares left, and accepts everyone else only to refuse them at once, so that
 * they learn why instead of waiting in the backlog (the EMFILE trick).  When accept fails with
 * no spare left (or for want of kernel memory), the listening socket rests, 10 ms the first
 * time and twice as long each time after up to 1 s, until an accept succeeds again.  Each
 * shortage and each pause is logged once (and at most once every 30 s), not per attempt.
 */
#include "config.h"

#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <event2/event.h>
#include <event2/thread.h>

#include "levent.h"
#include "client/client.h"
#include "engine/engine.h"
#include "gpu/gpu.h"
#include "cluster/cluster.h"
#include "fabric/fabric.h"


static struct event_base *base;
static int listen_fd = -1;
static bool own_socket;
static bool activated;               /* systemd's socket: its unit decides path and mode */
static struct gpxd_args args;
static char socket_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static struct event *listen_ev, *reap_ev, *wd_ev, *status_ev, *stop_ev, *resume_ev, *wake_ev;
static struct event *sig_ev[4];
static bool stopping;

#define HELLO_TIMEOUT_S 5.0
static int exit_status;
static double stop_deadline;

#define SHORT_LOG_S 30.0             /* at most one line about descriptors this often */
static int spare[RESERVED_FDS_MAX];
static uint32_t nspare;
static unsigned long long nofile;    /* the descriptor limit */
static bool fd_short;                /* spares given up: root and the admin group only */
static bool fd_short_logged;         /* ... and that was said */
static double fd_short_since, fd_short_said;
static uint64_t fd_short_refused;    /* connections refused while short */
static double pause_s;               /* accept's rest while no descriptor is left; 0 = none */
static double pause_said;

static void
conn_cb(evutil_socket_t fd, short what, void *arg)
{
	double t0 = loop_turn_begin();

	(void)fd;
	(void)what;
	conn_input(arg);
	loop_turn_end(t0);
}

static void
pidfd_cb(evutil_socket_t fd, short what, void *arg)
{
	double t0 = loop_turn_begin();

	(void)fd;
	(void)what;
	conn_kill(arg, "client process exited");
	loop_turn_end(t0);
}

static void levent_conn_unwatch(struct conn *c);

/* False: out of memory for the events (nothing is watched then). */
static bool
levent_conn_watch(struct conn *c)
{
	if ((c->ev = event_new(base, c->fd, EV_READ | EV_PERSIST, conn_cb, c)) == NULL ||
	    (c->pidfd >= 0 && (c->pidev = event_new(base, c->pidfd, EV_READ, pidfd_cb, c)) == NULL) ||
	    event_add(c->ev, NULL) < 0 || (c->pidev != NULL && event_add(c->pidev, NULL) < 0)) {
		levent_conn_unwatch(c);
		return false;
	}
	return true;
}

/* A connection whose transfer a task thread checks: its socket is not read meanwhile. */
static void
levent_conn_pause(struct conn *c, bool pause)
{
	if (c->ev == NULL)
		return;
	if (pause)
		event_del(c->ev);
	else
		event_add(c->ev, NULL);
}

static void
levent_conn_unwatch(struct conn *c)
{
	if (c->ev != NULL)
		event_free(c->ev);
	if (c->pidev != NULL)
		event_free(c->pidev);
	c->ev = c->pidev = NULL;
}

static void
reap_cb(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	(void)arg;
	double t0 = loop_turn_begin();
	/* (a gone client's handles, a slice at a time: the rest after the next look at the sockets) */
	if (conn_reap()) {
		struct timeval now = { 0, 0 };
		event_add(reap_ev, &now);
	}
	loop_turn_end(t0);
}

/* Thread-safe: copy workers call it (through cq.c) when a client misused its queue. */
static void
levent_request_reap(void)
{
	/* Without a running loop (tests driving conn.c directly) the caller reaps. */
	if (reap_ev != NULL)
		event_active(reap_ev, EV_TIMEOUT, 0);
}

static void
cq_broken(struct cq *q)
{
	(void)q;
	levent_request_reap();
}

static void
resume_cb(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	(void)arg;
	if (!stopping)
		event_add(listen_ev, NULL);
}

/* Raises the soft descriptor limit to the hard one (the kernel's nr_open where that is unlimited). */
static void
nofile_raise(void)
{
	struct rlimit rl;
	unsigned long long was;

	if (getrlimit(RLIMIT_NOFILE, &rl) < 0)
		return;
	was = rl.rlim_cur;
	if (rl.rlim_cur < rl.rlim_max) {
		rlim_t want = rl.rlim_max;
		rl.rlim_cur = want;
		if (setrlimit(RLIMIT_NOFILE, &rl) < 0) {
			unsigned long long n = sysctl_number("/proc/sys/fs/nr_open");
			rl.rlim_cur = n > was && n < (unsigned long long)want ? (rlim_t)n : (rlim_t)was;
			if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
				rl.rlim_cur = was;
		}
	}
	nofile = rl.rlim_cur;
	if (nofile != was)
		log_info("descriptor limit %llu (raised from %llu)", nofile, was);
	else
		log_info("descriptor limit %llu", nofile);
}

/*
 * Holds reserved_fds spares again (fewer or more after a reload).  While short, all of them
 * or none: the descriptors root's connections need must not be taken back one by one.
 */
static void
spares_fill(void)
{
	uint32_t had = nspare;

	while (nspare > cfg->reserved_fds)
		close(spare[--nspare]);
	while (nspare < cfg->reserved_fds) {
		int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			break;
		spare[nspare++] = fd;
	}
	if (!fd_short)
		return;
	if (nspare < cfg->reserved_fds) {
		while (nspare > had)
			close(spare[--nspare]);
		return;
	}
	fd_short = false;
	if (fd_short_logged)
		log_info("descriptors free again after %.1f s: admitting everyone (%llu connections refused meanwhile)",
		    now_s() - fd_short_since, (unsigned long long)fd_short_refused);
}

/* accept(2) found the table full: the spares go to root and the admin group. */
static void
spares_release(void)
{
	double now = now_s();

	while (nspare > 0)
		close(spare[--nspare]);
	if (fd_short)
		return;
	fd_short = true;
	fd_short_since = now;
	fd_short_refused = 0;
	fd_short_logged = now - fd_short_said >= SHORT_LOG_S || fd_short_said == 0;
	if (fd_short_logged) {
		fd_short_said = now;
		log_warnx("out of file descriptors (limit %llu): admitting only root and the admin group "
		    "until %u are free again", nofile, cfg->reserved_fds);
	}
}

/* accept(2) failed for want of descriptors or memory: the listening socket rests a while. */
static void
accept_pause(int err)
{
	double now = now_s();

	pause_s = pause_s == 0 ? 0.01 : pause_s * 2 < 1 ? pause_s * 2 : 1;
	if (pause_s == 0.01 && (pause_said == 0 || now - pause_said >= SHORT_LOG_S)) {
		pause_said = now;
		log_warnx("accept: %s: not accepting for up to 1 s at a time until it succeeds again",
		    strerror(err));
	}
	struct timeval tv = { 0, (long)(pause_s * 1e6) };
	if (pause_s >= 1) {
		tv.tv_sec = 1;
		tv.tv_usec = 0;
	}
	event_del(listen_ev);
	event_add(resume_ev, &tv);
}

static void
accept_cb(evutil_socket_t lfd, short what, void *arg)
{
	double t0 = loop_turn_begin();

	(void)what;
	(void)arg;
	for (int i = 0; i < 64; i++) {
		int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno == EMFILE && nspare > 0) {
				spares_release();
				continue;
			}
			if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
				accept_pause(errno);
			else if (errno == ECONNABORTED || errno == EINTR)
				continue;
			break;
		}
		pause_s = 0;
		struct conn *c = conn_accept(fd, fd_short);
		if (c == NULL) {
			fd_short_refused += fd_short;
			continue;
		}
		if (!levent_conn_watch(c)) {
			conn_reply(c, 0, GPX__STATUS__ENOMEM, "gpxd is out of memory", NULL, NULL, 0);
			conn_kill(c, "out of memory watching its socket");
		}
	}
	loop_turn_end(t0);
}

/* A stale socket file (no one listening) is replaced; a live one means another gpxd runs. */
static int
listen_on(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd;

	if (strlen(path) >= sizeof(sa.sun_path) || path[0] != '/') {
		log_warnx("socket path %s: must be absolute and shorter than %zu bytes", path, sizeof(sa.sun_path));
		return -1;
	}
	strcpy(sa.sun_path, path);
	if ((fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)) < 0) {
		log_warn("socket");
		return -1;
	}
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 || errno == EAGAIN) {
		log_warnx("%s: another gpxd is listening there", path);
		close(fd);
		return -1;
	}
	close(fd);
	unlink(path);
	fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	mode_t old = umask(0177);
	int r = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
	umask(old);
	if (r < 0) {
		log_warn("bind %s", path);
		close(fd);
		return -1;
	}
	if (cfg->socket_group != NULL) {
		struct group *g = getgrnam(cfg->socket_group);
		if (g == NULL || chown(path, (uid_t)-1, g->gr_gid) < 0)
			log_warn("socket group %s", cfg->socket_group);
	}
	/* The kernel's most: a burst of clients waits there, costing the daemon no descriptor. */
	if (chmod(path, cfg->socket_mode) < 0 || listen(fd, SOMAXCONN) < 0) {
		log_warn("listen %s", path);
		close(fd);
		unlink(path);
		return -1;
	}
	own_socket = true;
	return fd;
}

static void
status_line(char *buf, size_t len)
{
	snprintf(buf, len, "%u clients, %u transfers in flight, %u exports; cuda: %s",
	    conn_count(), engine_inflight(), export_count(), gpu_status());
}

static void
status_cb(evutil_socket_t fd, short what, void *arg)
{
	char s[256];

	(void)fd;
	(void)what;
	(void)arg;
	status_line(s, sizeof(s));
	sdn_status(s);
}

static void
wd_cb(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	(void)arg;
	double t0 = loop_turn_begin();
	sdn_watchdog();
	spares_fill();
	user_log_tick(false);
	/*
	 * Connections that never said Hello are closed after HELLO_TIMEOUT_S; idle ones (nothing
	 * received for idle_timeout seconds, when configured) too.  A connection with transfers in
	 * flight, or operations on a task thread, is not idle, however long it says nothing (a
	 * client waits for a long copy): its idle time starts again from the tick that finds it so.
	 */
	struct conn *c, *t;
	double now = now_s();
	TAILQ_FOREACH_SAFE(c, &conns, entry, t) {
		if (c->state == CONN_HELLO && now - c->t_connect > HELLO_TIMEOUT_S)
			conn_kill(c, "no Hello in time");
		else if (cfg->idle_timeout_s > 0 && now - c->t_last > cfg->idle_timeout_s) {
			if (c->pending > 0 || (c->cq != NULL && cq_busy(c->cq)))
				c->t_last = now;
			else
				conn_kill(c, "idle timeout");
		}
	}
	loop_turn_end(t0);
}

/*
 * A reload reads and checks the whole file into a new snapshot before anything changes; a bad
 * value, or a metrics endpoint that cannot be served, refuses it and the running one stays.
 * Keys that wait for a restart keep their running values in the new snapshot, so that it says
 * what runs; the report names them, and those the command line fixed.
 */
static int
levent_reload(char *msg, size_t msglen)
{
	char err[512], live[512], restart[512], over[128], fixed[128], file[PATH_MAX];
	const char *path = NULL;
	struct conf *n;
	int r = -1;

	sdn_reloading();
	/* A daemon started without a file reads the default one once there is one. */
	if (cfg->path != NULL || access(GPXD_CONF, F_OK) == 0) {
		snprintf(file, sizeof(file), "%s", cfg->path ? cfg->path : GPXD_CONF);
		path = file;
	}
	if ((n = conf_new()) == NULL) {
		snprintf(err, sizeof(err), "out of memory");
		r = -ENOMEM;
		goto refuse;
	}
	if (path != NULL && (r = conf_load(n, path, err, sizeof(err))) < 0)
		goto refuse;
	snprintf(fixed, sizeof(fixed), "%s%s%s", args.socket != NULL || activated ? "daemon.socket " : "",
	    activated ? "daemon.socket_mode daemon.socket_group " : "", args.log_fixed ? "daemon.log_level" : "");
	if (conf_diff(cfg, n, fixed, live, restart, over, sizeof(live)) < 0) {
		snprintf(err, sizeof(err), "out of memory");
		r = -ENOMEM;
		goto refuse;
	}
	if ((r = metrics_reload(n, err, sizeof(err))) < 0)
		goto refuse;
	if (!args.log_fixed)
		log_set_level(n->log_level);
	conf_publish(n);
	conn_admin_check();
	log_info("configuration reloaded from %s; applied: %s; waiting for a restart: %s%s%s",
	    path ? path : "(defaults)", live[0] ? live : "-", restart[0] ? restart : "-",
	    over[0] ? "; kept from the command line: " : "", over);
	snprintf(msg, msglen, "from %s\napplied %s\nrestart %s\ncommand-line %s", path ? path : "(defaults)",
	    live, restart, over);
	char s[256];
	status_line(s, sizeof(s));
	sdn_ready(s);
	return 0;

refuse:
	log_warnx("reload refused, keeping the running configuration: %s", err);
	snprintf(msg, msglen, "%s", err);
	if (n != NULL)
		conf_drop(n);
	sdn_ready("reload failed");
	return r == -ENOMEM ? -ENOMEM : -1;
}

/*
 * Graceful stop, step 2: once nothing is in flight and every submission queued before is
 * taken (or after 5 s), close everything.  The loop takes them a turn's slice at a time, and
 * those that end at their check are never in flight: without the second condition they went
 * unanswered with the connection.
 */
static void
stop_cb(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	(void)arg;
	if ((engine_inflight() > 0 || conn_sq_pending()) && now_s() < stop_deadline) {
		struct timeval tv = { 0, 10000 };
		event_add(stop_ev, &tv);
		return;
	}
	struct conn *c;
	while ((c = TAILQ_FIRST(&conns)) != NULL)
		conn_kill(c, "daemon stopping");
	event_base_loopexit(base, NULL);
}

static void
levent_stop(int status)
{
	struct timeval tv = { 0, 0 };

	if (stopping)
		return;
	stopping = true;
	exit_status = status;
	sdn_stopping();
	log_info("stopping: %u transfers in flight end with ESHUTDOWN", engine_inflight());
	event_del(listen_ev);
	engine_cancel_all(GPX__STATUS__ESHUTDOWN);
	cluster_stopping();
	stop_deadline = now_s() + 5;
	event_add(stop_ev, &tv);
}

static void
signal_cb(evutil_socket_t sig, short what, void *arg)
{
	char msg[1024];

	(void)what;
	(void)arg;
	double t0 = loop_turn_begin();
	if (sig == SIGHUP)
		levent_reload(msg, sizeof(msg));
	else
		levent_stop(0);
	loop_turn_end(t0);
}

/*
 * The loop.  While requests keep arriving (the last one less than daemon.busy_poll_us ago) it
 * polls without sleeping, so that a client submitting back to back never pays for waking this
 * thread (on virtual machines that costs 100 us and more, which showed as 15% of the bandwidth
 * of 256 MiB GPU copies); once traffic pauses it blocks in epoll as usual.  In between, while
 * transfers are in flight and no client has sent anything for NAP_AFTER_S, it naps: clients
 * that only wait for their copies send nothing until one ends, and the end of each wakes the
 * loop (loop_wake) to poll again for the request it brings.  Polling through a long copy cost
 * a core per client for nothing (2.0 cores of gpxd's with one GPU's copy worker).
 */
#define NAP_AFTER_S 200e-6

static double woken_at;     /* when the end of a transfer last woke the loop */

static void
wake_cb(evutil_socket_t fd, short what, void *arg)
{
	uint64_t n;

	(void)what;
	(void)arg;
	if (read(fd, &n, sizeof(n)) < 0) {
		/* EAGAIN: a second wake-up found the counter drained */
	}
	woken_at = now_s();
}

static void
levent_dispatch(void)
{
	bool polling = false;

	while (!event_base_got_exit(base) && !event_base_got_break(base)) {
		double t0 = loop_turn_begin();
		double active = conn_last_input > woken_at ? conn_last_input : woken_at;
		bool busy = t0 - active < cfg->busy_poll_us / 1e6;
		/* (a pass cut at the turn's slice left submissions: the next comes before any sleep) */
		if (conn_sq_left() || (busy && (t0 - active < NAP_AFTER_S || engine_inflight() == 0))) {
			conn_poll_all(polling ? SQ_POLL : SQ_POLLING);
			loop_turn_end(t0);
			polling = true;
			event_base_loop(base, EVLOOP_NONBLOCK);
			continue;
		}
		/* About to sleep or nap: ask for kicks, then look once more (conn_poll_all). */
		if (polling) {
			polling = false;
			int n = conn_poll_all(SQ_SLEEPING);
			loop_turn_end(t0);
			if (n > 0)
				continue;
		}
		if (busy) {
			/* A nap: the end of a transfer (or a client's kick, or a timer) wakes it. */
			loop_nap(true);
			if (engine_inflight() > 0)
				event_base_loop(base, EVLOOP_ONCE);
			loop_nap(false);
			continue;
		}
		event_base_loop(base, EVLOOP_ONCE);
	}
}

int
levent_run(const struct gpxd_args *a)
{
	const char *socket_override = a->socket;

	static const int sigs[] = { SIGTERM, SIGINT, SIGHUP };
	char why[256], s[256];
	struct timeval tv;

	args = *a;
	gpxd_start_time = now_s();
	signal(SIGPIPE, SIG_IGN);
	nofile_raise();
	if (evthread_use_pthreads() < 0)
		fatalx("libevent without thread support");
	if ((base = event_base_new()) == NULL)
		fatalx("event_base_new failed");

	if ((listen_fd = sdn_listen_fd()) >= 0) {
		struct sockaddr_un sa;
		socklen_t l = sizeof(sa);
		if (getsockname(listen_fd, (struct sockaddr *)&sa, &l) == 0 && l > sizeof(sa_family_t))
			snprintf(socket_path, sizeof(socket_path), "%s", sa.sun_path);
		evutil_make_socket_nonblocking(listen_fd);
		activated = true;
		log_info("listening on %s (socket activation)", socket_path);
	} else {
		const char *p = socket_override ? socket_override : cfg->socket_path;
		if ((listen_fd = listen_on(p)) < 0)
			return 1;
		snprintf(socket_path, sizeof(socket_path), "%s", p);
		log_info("listening on %s", socket_path);
	}
	gpxd_socket_path = socket_path;

	/*
	 * What comes back up from below comes through callbacks, registered here before the
	 * threads that call them start.  Then the engine: the GPU workers that gpu_init starts
	 * wait on its queues at once.
	 */
	static struct conn_loop loop = {
		.unwatch = levent_conn_unwatch,
		.pause = levent_conn_pause,
		.request_reap = levent_request_reap,
		.reload = levent_reload,
	};
	loop.base = base;
	conn_init(&loop);
	cq_set_broken_hook(cq_broken);
	engine_on_done(metrics_job_done);
	gpu_on_idle(xfer_help);
	if (defer_init(base, cfg->blocking_threads) < 0 || engine_init(cfg->workers, cfg->chunk_size) < 0)
		fatalx("cannot start worker threads");
	if (cfg->cuda) {
		if (gpu_init(why, sizeof(why)) < 0)
			log_info("GPU memory unavailable, serving host memory: %s", why);
	}
	metrics_start(base);
	/* The fabric: peer daemons (daemon/fabric/), only when gpxd.conf asks for it. */
	if (fabric_configured(cfg) && (fabric = fabric_init(base)) == NULL)
		fatalx("fabric: cannot start (see above)");
	/* The cluster: membership and names in etcd (daemon/cluster/), only when configured. */
	if (cluster_configured(&cfg->cluster) && cluster_start(base) < 0)
		fatalx("cluster: cannot start (see above)");

	conn_admin_check();
	spares_fill();
	listen_ev = event_new(base, listen_fd, EV_READ | EV_PERSIST, accept_cb, NULL);
	event_add(listen_ev, NULL);
	resume_ev = evtimer_new(base, resume_cb, NULL);
	reap_ev = event_new(base, -1, 0, reap_cb, NULL);
	stop_ev = evtimer_new(base, stop_cb, NULL);
	for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
		sig_ev[i] = evsignal_new(base, sigs[i], signal_cb, NULL);
		event_add(sig_ev[i], NULL);
	}
	uint64_t wd = sdn_watchdog_usec();
	uint64_t period = wd && wd / 2 < 1000000 ? wd / 2 : 1000000;   /* also drives timeouts */
	wd_ev = event_new(base, -1, EV_PERSIST, wd_cb, NULL);
	tv.tv_sec = period / 1000000;
	tv.tv_usec = period % 1000000;
	event_add(wd_ev, &tv);
	int wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (wake_fd < 0)
		fatal("eventfd");
	loop_nap_init(wake_fd);
	wake_ev = event_new(base, wake_fd, EV_READ | EV_PERSIST, wake_cb, NULL);
	event_add(wake_ev, NULL);
	status_ev = event_new(base, -1, EV_PERSIST, status_cb, NULL);
	tv.tv_sec = 10;
	tv.tv_usec = 0;
	event_add(status_ev, &tv);

	status_line(s, sizeof(s));
	sdn_ready(s);
	log_info("gpxd %s ready (protocol %d, %d copy workers)", GPXD_VERSION, GPX_PROTO_VERSION, cfg->workers);
	levent_dispatch();

	/* Shutdown: everything below runs with no client left. */
	if (fabric != NULL)
		fabric->stop();              /* fabric: what waits on peers fails now */
	cluster_stop();                  /* our keys in etcd go with our lease */
	engine_shutdown();
	defer_shutdown();
	conn_reap();
	gpu_shutdown();
	user_log_tick(true);
	while (nspare > 0)
		close(spare[--nspare]);
	if (own_socket)
		unlink(socket_path);
	close(listen_fd);
	event_free(listen_ev);
	event_free(resume_ev);
	event_free(reap_ev);
	event_free(stop_ev);
	event_free(wd_ev);
	event_free(status_ev);
	close(event_get_fd(wake_ev));
	event_free(wake_ev);
	for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++)
		event_free(sig_ev[i]);
	metrics_stop();
	event_base_free(base);
	base = NULL;
	log_info("stopped");
	return exit_status;
}
