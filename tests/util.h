/*
 * Small tools the test programs share: a monotonic clock in seconds, a checksum of a buffer
 * (FNV-1a), a xorshift generator and a deterministic fill of a buffer from a seed with it,
 * a count of a process's open descriptors, the CPU time /proc gives a process or thread, and
 * a datagram sent with descriptors that proto/wire.c would refuse to send.  Header-only.
 */
#ifndef GPX_TESTS_UTIL_H
#define GPX_TESTS_UTIL_H

#include <dirent.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>

/*
 * The longest a well-behaved client's small copy may take while another client misbehaves:
 * gpxd gives a stuck doorbell 10 ms (daemon/core/cq.c); the rest is for a slow, shared machine and
 * the sanitizer build.
 */
#define BYSTANDER_MAX_S 0.2

/* qsort's comparison of doubles, ascending. */
static inline int
cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

static inline double
now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static inline uint64_t
fnv(const void *p, size_t n)
{
	const unsigned char *b = p;
	uint64_t h = 0xcbf29ce484222325ULL;

	for (size_t i = 0; i < n; i++)
		h = (h ^ b[i]) * 0x100000001b3ULL;
	return h;
}

static inline uint64_t
xorshift(uint64_t *x)
{
	*x ^= *x << 13;
	*x ^= *x >> 7;
	*x ^= *x << 17;
	return *x;
}

static inline void
fill(void *p, size_t n, unsigned seed)
{
	uint64_t x = seed * 0x9e3779b97f4a7c15ULL + 1;

	for (size_t i = 0; i < n; i += 8) {
		xorshift(&x);
		memcpy((char *)p + i, &x, n - i < 8 ? n - i : 8);
	}
}

/* The entries of a /proc/PID/fd directory: that process's open descriptors, or -1. */
static inline int
fds_in(const char *dir)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	int n = 0;

	if (d == NULL)
		return -1;
	while ((e = readdir(d)) != NULL)
		if (e->d_name[0] != '.')
			n++;
	closedir(d);
	return n;
}

/*
 * The CPU time in a /proc stat file (/proc/PID/stat, or a thread's /proc/PID/task/TID/stat):
 * utime + stime in clock ticks, -1 if unreadable; its name (comm) into name when not NULL.
 */
static inline long
proc_stat_ticks(const char *path, char name[16])
{
	char line[1024], *open, *close;
	unsigned long ut, st;
	FILE *f = fopen(path, "re");

	if (f == NULL)
		return -1;
	bool got = fgets(line, sizeof(line), f) != NULL;
	fclose(f);
	if (!got || (open = strchr(line, '(')) == NULL || (close = strrchr(line, ')')) == NULL ||
	    sscanf(close + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
		return -1;
	if (name != NULL)
		snprintf(name, 16, "%.*s", (int)(close - open - 1), open + 1);
	return (long)(ut + st);
}

/*
 * Sends buf as one datagram with nfds descriptors, whatever the length and the count (the
 * tests' wrong input); what sendmsg returns.
 */
static inline ssize_t
send_fds(int sock, const void *buf, size_t len, const int *fds, int nfds)
{
	size_t clen = CMSG_SPACE(nfds * sizeof(int));
	char *cbuf = calloc(1, clen ? clen : 1);
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	ssize_t n;

	if (nfds > 0) {
		mh.msg_control = cbuf;
		mh.msg_controllen = clen;
		struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
		memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
	}
	n = sendmsg(sock, &mh, MSG_NOSIGNAL);
	free(cbuf);
	return n;
}

/* A test program's parts: the one argv[1] names, or all of them in order. */
struct test_part {
	const char *name;
	void (*run)(void);
};

static inline void
run_parts(int argc, char **argv, const struct test_part *parts, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (argc < 2 || strcmp(argv[1], parts[i].name) == 0)
			parts[i].run();
}

#endif
