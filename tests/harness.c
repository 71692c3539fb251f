/*
 * The integration tests' harness (see harness.h): starts a real gpxd on a private socket with a
 * configuration written here, measures its descriptor baseline, stops it with SIGTERM, and
 * speaks the wire protocol directly where the tests need input libgpxclient never sends.
 *
 * The baseline is measured without guessing at timing: with one query-only connection open and
 * the daemon reporting exactly one client, and again with two, the difference is what one such
 * connection costs; the baseline is the first count minus that.
 */
#include "config.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <netinet/in.h>

#include "tests/harness.h"
#include "tests/util.h"
#include "tests/tap.h"

/* The configuration every integration test runs with; `extra` may add sections after it. */
static const char base_conf[] =
    "# written by the gpx test harness\n"
    "[daemon]\n"
    "socket_mode = 0666\n"
    "workers = 2\n"
    "blocking_threads = 2\n"
    "ring_entries = 64\n"
    "chunk_size = 64K\n"
    "max_segments = 131072\n"
    "log_level = info\n";

static void
msleep(int ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

static double
mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int
harness_fds(const struct harness *h)
{
	char path[64];

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)h->pid);
	return fds_in(path);
}

int
harness_wait_fds(const struct harness *h, int want, int timeout_ms)
{
	double end = mono_ms() + timeout_ms;
	int n;

	while ((n = harness_fds(h)) != want && n >= 0 && mono_ms() < end)
		msleep(5);
	return n;
}

bool
harness_log_has(const struct harness *h, const char *needle)
{
	char line[2048];
	bool hit = false;
	FILE *f = fopen(h->log, "re");

	if (f == NULL)
		return false;
	while (!hit && fgets(line, sizeof(line), f) != NULL)
		hit = strstr(line, needle) != NULL;
	fclose(f);
	return hit;
}

void
harness_dump_log(const struct harness *h)
{
	char line[1024];
	FILE *f = fopen(h->log, "r");

	if (f == NULL)
		return;
	diag("---- gpxd log (%s) ----", h->log);
	while (fgets(line, sizeof(line), f) != NULL) {
		line[strcspn(line, "\n")] = '\0';
		diag("%s", line);
	}
	fclose(f);
}

int
harness_connect(const struct harness *h)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);

	if (fd < 0)
		return -1;
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", h->sock);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		close(fd);
		return -1;
	}
	return fd;
}

int
harness_send(int sock, Gpx__ClientMsg *m, const int *fds, int nfds)
{
	return wire_send_msg(sock, &m->base, fds, nfds);
}

Gpx__DaemonMsg *
harness_recv(int sock, int timeout_ms, int *fds, int *nfds, bool *eof)
{
	static uint8_t buf[GPX_MSG_MAX];
	struct pollfd p = { .fd = sock, .events = POLLIN };
	int lfds[GPX_MAX_FDS], lnfds = 0;
	ssize_t n;

	if (eof != NULL)
		*eof = false;
	if (nfds != NULL)
		*nfds = 0;
	if (poll(&p, 1, timeout_ms) != 1)
		return NULL;
	n = wire_recv(sock, buf, NULL, lfds, &lnfds, GPX_MAX_FDS, MSG_DONTWAIT);
	if (n <= 0) {
		if (eof != NULL)
			*eof = n == 0 || n == -ECONNRESET;
		return NULL;
	}
	Gpx__DaemonMsg *m = gpx__daemon_msg__unpack(NULL, n, buf);
	if (m == NULL || m->body_case != GPX__DAEMON_MSG__BODY_REPLY) {
		wire_close_fds(lfds, lnfds);
		if (m != NULL)
			gpx__daemon_msg__free_unpacked(m, NULL);
		return NULL;
	}
	if (fds != NULL) {
		memcpy(fds, lfds, lnfds * sizeof(int));
		*nfds = lnfds;
	} else
		wire_close_fds(lfds, lnfds);
	return m;
}

Gpx__DaemonMsg *
harness_hello(int sock, uint32_t version, int efd, int *ring_fd)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Hello hello = GPX__HELLO__INIT;
	int fds[GPX_MAX_FDS], nfds;

	hello.version = version;
	hello.name = (char *)"harness";
	hello.no_ring = efd < 0;
	m.seq = 1;
	m.body_case = GPX__CLIENT_MSG__BODY_HELLO;
	m.hello = &hello;
	if (harness_send(sock, &m, efd >= 0 ? &efd : NULL, efd >= 0) < 0)
		return NULL;
	Gpx__DaemonMsg *r = harness_recv(sock, 20000, fds, &nfds, NULL);
	if (ring_fd != NULL)
		*ring_fd = -1;
	if (r != NULL && nfds == 1 && ring_fd != NULL)
		*ring_fd = fds[0];
	else
		wire_close_fds(fds, nfds);
	return r;
}

int
harness_request(int sock, Gpx__ClientMsg *m, const int *fds, int nfds, int timeout_ms, Gpx__DaemonMsg **reply)
{
	Gpx__DaemonMsg *d;
	int st;

	if (reply != NULL)
		*reply = NULL;
	if (harness_send(sock, m, fds, nfds) < 0 || (d = harness_recv(sock, timeout_ms, NULL, NULL, NULL)) == NULL)
		return -1;
	st = (int)d->reply->status;
	if (reply != NULL)
		*reply = d;
	else
		gpx__daemon_msg__free_unpacked(d, NULL);
	return st;
}

Gpx__DaemonMsg *
harness_register_legacy(const struct harness *h)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Register reg = GPX__REGISTER__INIT;
	Gpx__DaemonMsg *r;
	uint8_t handle[64] = { 1 }, uuid[16] = { 2 };
	int s = harness_connect(h), efd = eventfd(0, EFD_CLOEXEC), ring = -1;

	if ((r = harness_hello(s, GPX_PROTO_VERSION, efd, &ring)) != NULL)
		gpx__daemon_msg__free_unpacked(r, NULL);
	reg.kind = GPX__MEM_KIND__MEM_CUDA_IPC;
	reg.length = 4096;
	reg.handle.data = handle;
	reg.handle.len = 64;
	reg.device_uuid.data = uuid;
	reg.device_uuid.len = 16;
	m.seq = 3;
	m.body_case = GPX__CLIENT_MSG__BODY_REGISTER;
	m.register_ = &reg;
	r = NULL;
	harness_request(s, &m, NULL, 0, 5000, &r);
	close(s);
	close(efd);
	if (ring >= 0)
		close(ring);
	return r;
}

int
harness_area_client(const struct harness *h, uint32_t version, unsigned char **area, size_t len)
{
	int s = harness_connect(h), efd = eventfd(0, EFD_CLOEXEC);
	int mfd = memfd_create("harness-area", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__SegArea sa = GPX__SEG_AREA__INIT;
	Gpx__DaemonMsg *d = NULL;
	bool ok = false;

	*area = MAP_FAILED;
	if (s >= 0 && efd >= 0 && mfd >= 0 && ftruncate(mfd, len) == 0 && fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK) == 0 &&
	    (d = harness_hello(s, version, efd, NULL)) != NULL && d->reply->status == 0) {
		sa.length = len;
		m.seq = 2;
		m.body_case = GPX__CLIENT_MSG__BODY_SEG_AREA;
		m.seg_area = &sa;
		ok = harness_request(s, &m, &mfd, 1, 20000, NULL) == 0 &&
		    (*area = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0)) != MAP_FAILED;
	}
	if (d != NULL)
		gpx__daemon_msg__free_unpacked(d, NULL);
	if (efd >= 0)
		close(efd);
	if (mfd >= 0)
		close(mfd);
	if (!ok && s >= 0) {
		close(s);
		s = -1;
	}
	return s;
}

bool
harness_wait_eof(int sock, int timeout_ms)
{
	double end = mono_ms() + timeout_ms;
	bool eof = false;

	while (!eof && mono_ms() < end) {
		Gpx__DaemonMsg *m = harness_recv(sock, 100, NULL, NULL, &eof);
		if (m != NULL)
			gpx__daemon_msg__free_unpacked(m, NULL);
	}
	return eof;
}

/* One Q_STATUS round trip on an established query-only connection: the client count, or -1. */
/* The daemon's status counts over a welcomed query connection; 0 or -1. */
static int
status_read(int sock, struct harness_status *st)
{
	Gpx__ClientMsg m = GPX__CLIENT_MSG__INIT;
	Gpx__Query q = GPX__QUERY__INIT;
	int r = -1;

	q.what = GPX__QUERY_WHAT__Q_STATUS;
	m.seq = 2;
	m.body_case = GPX__CLIENT_MSG__BODY_QUERY;
	m.query = &q;
	if (harness_send(sock, &m, NULL, 0) < 0)
		return -1;
	Gpx__DaemonMsg *d = harness_recv(sock, 20000, NULL, NULL, NULL);
	if (d != NULL && d->reply->status == 0 && d->reply->body_case == GPX__REPLY__BODY_QUERY &&
	    d->reply->query->status != NULL) {
		const Gpx__DaemonStatus *s = d->reply->query->status;
		st->clients = (int)s->clients;
		st->regions = (int)s->regions;
		st->exports = (int)s->exports;
		st->inflight = (int)s->inflight;
		st->cache_ipc = s->cache_ipc;
		st->cache_pool = s->cache_pool;
		st->cache_vmm = s->cache_vmm;
		st->cache_opens = s->cache_opens;
		st->cache_hits = s->cache_hits;
		r = 0;
	}
	if (d != NULL)
		gpx__daemon_msg__free_unpacked(d, NULL);
	return r;
}

static int
status_clients(int sock)
{
	struct harness_status st;

	return status_read(sock, &st) == 0 ? st.clients : -1;
}

/* A query-only connection that has been welcomed, or -1. */
static int
query_conn(const struct harness *h)
{
	int s = harness_connect(h);

	if (s < 0)
		return -1;
	Gpx__DaemonMsg *r = harness_hello(s, GPX_PROTO_VERSION, -1, NULL);
	bool good = r != NULL && r->reply->status == 0;
	if (r != NULL)
		gpx__daemon_msg__free_unpacked(r, NULL);
	if (!good) {
		close(s);
		return -1;
	}
	return s;
}

int
harness_status(const struct harness *h, struct harness_status *st)
{
	int s = query_conn(h);
	int r;

	if (s < 0)
		return -1;
	r = status_read(s, st);
	close(s);
	return r;
}

int
harness_clients(const struct harness *h)
{
	int s = query_conn(h);
	int n;

	if (s < 0)
		return -1;
	n = status_clients(s);
	close(s);
	return n;
}

static int
write_file(const char *path, const char *a, const char *b)
{
	FILE *f = fopen(path, "w");

	if (f == NULL)
		return -1;
	fputs(a, f);
	if (b != NULL)
		fputs(b, f);
	return fclose(f) == 0 ? 0 : -1;
}

static bool
alive(struct harness *h)
{
	int st;

	if (waitpid(h->pid, &st, WNOHANG) == h->pid) {
		diag("gpxd exited early (status %#x)", st);
		h->pid = -1;
		return false;
	}
	return true;
}

/* The baseline as the file's opening comment describes it. */
static int
measure_baseline(struct harness *h)
{
	double end = mono_ms() + 20000;
	int a, b, n1, n2, clients;

	if ((a = query_conn(h)) < 0)
		return -1;
	/* The readiness probe may not have been reaped yet: wait until we are the only client. */
	while ((clients = status_clients(a)) != 1 && clients >= 0 && mono_ms() < end)
		msleep(5);
	n1 = clients == 1 ? harness_fds(h) : -1;
	if ((b = query_conn(h)) < 0 || status_clients(b) != 2) {
		close(a);
		if (b >= 0)
			close(b);
		return -1;
	}
	n2 = harness_fds(h);
	close(a);
	close(b);
	if (n1 < 0 || n2 <= n1)
		return -1;
	h->baseline = n1 - (n2 - n1);
	if (harness_wait_fds(h, h->baseline, 20000) != h->baseline) {
		diag("gpxd's descriptors do not settle at %d", h->baseline);
		return -1;
	}
	return 0;
}

int
harness_start(struct harness *h, const char *extra)
{
	return harness_start_nofile(h, extra, 0);
}

int
harness_start_nofile(struct harness *h, const char *extra, int nofile)
{
	const char *gpxd = getenv("GPXD");
	const char *tmp = getenv("TMPDIR");

	memset(h, 0, sizeof(*h));
	h->pid = -1;
	h->ring_entries = 64;
	h->nofile = nofile;
	if (gpxd == NULL || access(gpxd, X_OK) != 0) {
		diag("set GPXD to the gpxd binary (make check does)");
		return -1;
	}
	snprintf(h->dir, sizeof(h->dir), "%s/gpx-test.XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
	if (mkdtemp(h->dir) == NULL) {
		diag("mkdtemp %s: %s", h->dir, strerror(errno));
		return -1;
	}
	/* Other uids (the export-rule tests) must reach the socket inside. */
	chmod(h->dir, 0755);
	snprintf(h->sock, sizeof(h->sock), "%s/gpxd.sock", h->dir);
	snprintf(h->conf, sizeof(h->conf), "%s/gpxd.conf", h->dir);
	snprintf(h->log, sizeof(h->log), "%s/gpxd.log", h->dir);
	if (write_file(h->conf, base_conf, extra) < 0) {
		diag("cannot write %s", h->conf);
		return -1;
	}
	return harness_respawn(h);
}

void
harness_child_fds(int log)
{
	int null = open("/dev/null", O_RDWR);

	dup2(null, 0);
	dup2(null, 1);
	dup2(log, 2);
	/* Nothing of the test process leaks into the daemon's descriptor table. */
	for (int i = 3; i < 1024; i++)
		close(i);
}

int
harness_respawn(struct harness *h)
{
	const char *gpxd = getenv("GPXD");
	double end;
	int fd;

	if ((fd = open(h->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644)) < 0)
		return -1;
	fflush(NULL);
	h->pid = fork();
	if (h->pid < 0) {
		close(fd);
		return -1;
	}
	if (h->pid == 0) {
		harness_child_fds(fd);
		if (h->nofile > 0) {
			struct rlimit rl = { (rlim_t)h->nofile, (rlim_t)h->nofile };
			if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
				_exit(126);
		}
		unsetenv("NOTIFY_SOCKET");
		unsetenv("JOURNAL_STREAM");
		unsetenv("LISTEN_FDS");
		unsetenv("LISTEN_PID");
		unsetenv("WATCHDOG_USEC");
		execl(gpxd, "gpxd", "-f", "-s", h->sock, "-c", h->conf, (char *)NULL);
		_exit(127);
	}
	close(fd);

	/* Ready when the socket accepts a connection. */
	end = mono_ms() + 30000;
	for (;;) {
		int s = harness_connect(h);
		if (s >= 0) {
			close(s);
			break;
		}
		if (!alive(h) || mono_ms() > end) {
			diag("gpxd did not come up on %s", h->sock);
			harness_dump_log(h);
			return -1;
		}
		msleep(10);
	}
	if (measure_baseline(h) < 0) {
		diag("cannot measure gpxd's descriptor baseline");
		harness_dump_log(h);
		return -1;
	}
	return 0;
}

int
harness_stop(struct harness *h)
{
	double end = mono_ms() + 30000;
	int st;

	if (h->pid <= 0)
		return -1;
	kill(h->pid, SIGTERM);
	for (;;) {
		pid_t p = waitpid(h->pid, &st, WNOHANG);
		if (p == h->pid)
			break;
		if (p < 0 || mono_ms() > end) {
			diag("gpxd did not stop on SIGTERM; killing it");
			kill(h->pid, SIGKILL);
			waitpid(h->pid, &st, 0);
			h->pid = -1;
			return -1;
		}
		msleep(5);
	}
	h->pid = -1;
	if (WIFSIGNALED(st))
		diag("gpxd died of signal %d (%s)", WTERMSIG(st), strsignal(WTERMSIG(st)));
	return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

void
harness_finish(struct harness *h)
{
	int st = harness_stop(h);

	if (!ok(st == 0, "gpxd stopped cleanly (exit %d)", st))
		harness_dump_log(h);
	harness_cleanup(h);
}

void
harness_cleanup(struct harness *h)
{
	char path[PATH_MAX];
	struct dirent *e;
	DIR *d;

	if (h->pid > 0)
		harness_stop(h);
	if (h->dir[0] == '\0' || (d = opendir(h->dir)) == NULL)
		return;
	while ((e = readdir(d)) != NULL)
		if (e->d_name[0] != '.') {
			snprintf(path, sizeof(path), "%s/%s", h->dir, e->d_name);
			unlink(path);
		}
	closedir(d);
	rmdir(h->dir);
}

char *
harness_metrics(const struct harness *h)
{
	char line[512], *buf = NULL;
	unsigned port = 0;
	FILE *f = fopen(h->log, "re");
	size_t len = 0, cap = 1 << 20;
	struct sockaddr_in sa = { .sin_family = AF_INET };
	int s;

	while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
		char *p = strstr(line, "metrics endpoint on http://127.0.0.1:");
		if (p != NULL)
			port = (unsigned)atoi(p + strlen("metrics endpoint on http://127.0.0.1:"));
	}
	if (f != NULL)
		fclose(f);
	sa.sin_port = htons(port);
	sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (port == 0 || (s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0)
		return NULL;
	if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
	    write(s, "GET /metrics HTTP/1.0\r\n\r\n", 25) == 25 && (buf = malloc(cap)) != NULL) {
		ssize_t n;
		while (len < cap - 1 && (n = read(s, buf + len, cap - 1 - len)) > 0)
			len += n;
		buf[len] = '\0';
	}
	close(s);
	return buf;
}

double
harness_metric(const struct harness *h, const char *key)
{
	char *page = harness_metrics(h);
	const double v = page != NULL ? metrics_sample(page, key) : -1;

	free(page);
	return v;
}

double
metrics_sample(const char *page, const char *key)
{
	size_t kl = strlen(key);

	for (const char *p = page; p != NULL && *p != '\0'; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
		if (strncmp(p, key, kl) == 0 && p[kl] == ' ')
			return atof(p + kl + 1);
	return -1;
}
