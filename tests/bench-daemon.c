/*
 * gpx-bench's private gpxd (tests/bench.h): the daemon --spawn starts on a socket in a
 * temporary directory, with a configuration file of its own, and stops at the end; a signal
 * that ends gpx-bench first stops it too and removes the directory.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

#include "tests/bench.h"

static struct bench_daemon *live_daemon;

static void
remove_files(struct bench_daemon *d, bool keep_log)
{
	unlink(d->socket);
	unlink(d->conf);
	if (!keep_log) {
		unlink(d->log);
		rmdir(d->dir);
	}
}

/*
 * SIGINT, SIGTERM, SIGHUP or SIGPIPE (output piped into head) while a private daemon runs: stop
 * it and remove its directory (async-signal-safe calls only).
 */
static void
on_signal(int sig)
{
	struct bench_daemon *d = live_daemon;

	if (d != NULL && d->pid > 0) {
		kill(d->pid, SIGTERM);
		waitpid(d->pid, NULL, 0);
		remove_files(d, false);
	}
	_exit(128 + sig);
}

/* The gpxd to start: $GPXD, else next to this program (build tree or bin/../sbin), else PATH. */
static void
find_gpxd(char *out, size_t len)
{
	static const char *rel[] = { "gpxd", "../gpxd", "../sbin/gpxd" };
	const char *env = getenv("GPXD");
	char self[PATH_MAX];
	ssize_t n;

	if (env != NULL && env[0] != '\0') {
		snprintf(out, len, "%s", env);
		return;
	}
	if ((n = readlink("/proc/self/exe", self, sizeof(self) - 1)) > 0) {
		self[n] = '\0';
		char *slash = strrchr(self, '/');
		if (slash != NULL) {
			*slash = '\0';
			for (size_t i = 0; i < sizeof(rel) / sizeof(rel[0]); i++) {
				if (snprintf(out, len, "%s/%s", self, rel[i]) < (int)len &&
				    access(out, X_OK) == 0)
					return;
			}
		}
	}
	snprintf(out, len, "gpxd");
}

static bool
accepts(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	bool ok;

	if (fd < 0)
		return false;
	if (snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path) >= (int)sizeof(sa.sun_path)) {
		close(fd);
		return false;
	}
	ok = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
	close(fd);
	return ok;
}

static void
print_log(const struct bench_daemon *d)
{
	FILE *f = fopen(d->log, "re");
	char line[512];

	if (f == NULL)
		return;
	fprintf(stderr, "gpx-bench: gpxd's log (%s):\n", d->log);
	while (fgets(line, sizeof(line), f))
		fprintf(stderr, "  %s", line);
	fclose(f);
}

int
bench_daemon_start(struct bench_daemon *d, const char *const *settings, size_t nset)
{
	const char *tmp = getenv("TMPDIR");
	char bin[PATH_MAX];
	FILE *f;

	memset(d, 0, sizeof(*d));
	snprintf(d->dir, sizeof(d->dir), "%s/gpx-bench.XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
	if (mkdtemp(d->dir) == NULL) {
		fprintf(stderr, "gpx-bench: mkdtemp %s: %s\n", d->dir, strerror(errno));
		return -1;
	}
	snprintf(d->socket, sizeof(d->socket), "%s/gpxd.sock", d->dir);
	snprintf(d->conf, sizeof(d->conf), "%s/gpxd.conf", d->dir);
	snprintf(d->log, sizeof(d->log), "%s/gpxd.log", d->dir);
	if (strlen(d->socket) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
		fprintf(stderr, "gpx-bench: socket path %s is too long (set TMPDIR to a shorter "
		    "directory)\n", d->socket);
		rmdir(d->dir);
		return -1;
	}
	/* A configuration of its own, so that no system-wide gpxd.conf changes what is measured. */
	if ((f = fopen(d->conf, "we")) == NULL) {
		fprintf(stderr, "gpx-bench: %s: %s\n", d->conf, strerror(errno));
		rmdir(d->dir);
		return -1;
	}
	fprintf(f, "# gpxd started by gpx-bench --spawn\n");
	for (size_t i = 0; i < nset; i++) {
		const char *dot = strchr(settings[i], '.'), *eq = strchr(settings[i], '=');
		if (dot == NULL || eq == NULL || dot > eq || dot == settings[i] || eq == dot + 1) {
			fprintf(stderr, "gpx-bench: '%s' is not section.key=value\n", settings[i]);
			fclose(f);
			remove_files(d, false);
			return -1;
		}
		fprintf(f, "[%.*s]\n%.*s = %s\n", (int)(dot - settings[i]), settings[i],
		    (int)(eq - dot - 1), dot + 1, eq + 1);
	}
	fclose(f);

	find_gpxd(bin, sizeof(bin));
	pid_t parent = getpid();
	if ((d->pid = fork()) < 0) {
		fprintf(stderr, "gpx-bench: fork: %s\n", strerror(errno));
		remove_files(d, false);
		return -1;
	}
	if (d->pid == 0) {
		/* The daemon goes when we go, even if we are killed outright. */
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		if (getppid() != parent)
			_exit(1);
		int lfd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		int nfd = open("/dev/null", O_RDONLY | O_CLOEXEC);
		if (lfd < 0 || nfd < 0 || dup2(nfd, 0) < 0 || dup2(lfd, 1) < 0 || dup2(lfd, 2) < 0)
			_exit(127);
		/* Not the service manager's daemon: no readiness, activation or journal hand-over. */
		unsetenv("NOTIFY_SOCKET");
		unsetenv("LISTEN_FDS");
		unsetenv("LISTEN_PID");
		unsetenv("LISTEN_FDNAMES");
		unsetenv("JOURNAL_STREAM");
		unsetenv("WATCHDOG_USEC");
		unsetenv("WATCHDOG_PID");
		char *argv[] = { bin, "-f", "-c", d->conf, "-s", d->socket, NULL };
		if (strchr(bin, '/') != NULL)
			execv(bin, argv);
		else
			execvp(bin, argv);
		fprintf(stderr, "cannot run %s: %s\n", bin, strerror(errno));
		_exit(127);
	}
	live_daemon = d;
	signal(SIGINT, on_signal);
	signal(SIGTERM, on_signal);
	signal(SIGHUP, on_signal);
	signal(SIGPIPE, on_signal);

	for (double t0 = bench_now(); bench_now() - t0 < 10;) {
		int st;
		if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
			fprintf(stderr, "gpx-bench: gpxd (%s) exited before it was ready\n", bin);
			print_log(d);
			d->pid = 0;
			live_daemon = NULL;
			remove_files(d, false);
			return -1;
		}
		if (accepts(d->socket))
			return 0;
		usleep(10000);
	}
	fprintf(stderr, "gpx-bench: gpxd (%s) did not accept connections on %s within 10 s\n", bin,
	    d->socket);
	bench_daemon_stop(d);
	return -1;
}

int
bench_daemon_stop(struct bench_daemon *d)
{
	int st = 0, r = 0;

	if (d->pid <= 0)
		return 0;
	kill(d->pid, SIGTERM);
	for (double t0 = bench_now(); waitpid(d->pid, &st, WNOHANG) == 0;) {
		if (bench_now() - t0 > 10) {
			fprintf(stderr, "gpx-bench: gpxd did not stop within 10 s of SIGTERM; killing it\n");
			kill(d->pid, SIGKILL);
			waitpid(d->pid, &st, 0);
			r = -1;
			break;
		}
		usleep(5000);
	}
	if (r == 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
		fprintf(stderr, "gpx-bench: gpxd did not exit cleanly (%s %d)\n",
		    WIFEXITED(st) ? "status" : "signal", WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
		r = -1;
	}
	if (r < 0)
		print_log(d);
	d->pid = 0;
	live_daemon = NULL;
	signal(SIGINT, SIG_DFL);
	signal(SIGTERM, SIG_DFL);
	signal(SIGHUP, SIG_DFL);
	signal(SIGPIPE, SIG_DFL);
	remove_files(d, false);
	return r;
}
