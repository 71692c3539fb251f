/*
 * Loaded into gpxd with LD_PRELOAD by tests/alloc-fail: fails one allocation when told to.
 *
 * GPX_FAILALLOC names a file whose first four bytes (an int32 in host order) count down the
 * allocations gpxd makes (malloc, calloc, realloc, and what libc makes through them, such as
 * strdup): the one that takes the count from 1 to 0 returns NULL with errno ENOMEM, and every
 * other is served by libc.  The test writes the count through its own mapping of the file and
 * reads it back to learn whether that allocation came.  Without GPX_FAILALLOC nothing fails.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/mman.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

static _Atomic int32_t *countdown;

__attribute__((constructor)) static void
failalloc_init(void)
{
	const char *path = getenv("GPX_FAILALLOC");
	void *m;
	int fd;

	if (path == NULL || (fd = open(path, O_RDWR | O_CLOEXEC)) < 0)
		return;
	m = mmap(NULL, sizeof(*countdown), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m != MAP_FAILED)
		countdown = m;
}

/* Whether this allocation is the one to fail. */
static bool
fail_now(void)
{
	int32_t v;

	if (countdown == NULL)
		return false;
	v = atomic_load(countdown);
	while (v > 0)
		if (atomic_compare_exchange_weak(countdown, &v, v - 1))
			return v == 1;
	return false;
}

void *
malloc(size_t n)
{
	if (fail_now()) {
		errno = ENOMEM;
		return NULL;
	}
	return __libc_malloc(n);
}

void *
calloc(size_t n, size_t size)
{
	if (fail_now()) {
		errno = ENOMEM;
		return NULL;
	}
	return __libc_calloc(n, size);
}

void *
realloc(void *p, size_t n)
{
	if (fail_now()) {
		errno = ENOMEM;
		return NULL;
	}
	return __libc_realloc(p, n);
}
