/*
 * Small tools the test programs share: a monotonic clock in seconds, a checksum of a buffer
 * (FNV-1a), a xorshift generator and a deterministic fill of a buffer from a seed with it,
 * and a count of a process's open descriptors.  Header-only.
 */
#ifndef GPX_TESTS_UTIL_H
#define GPX_TESTS_UTIL_H

#include <dirent.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

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

#endif
