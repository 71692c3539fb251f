/*
 * Loaded into gpxd with LD_PRELOAD by tests/alloc-fail: fails one allocation when told to.
 *
 * GPX_FAILALLOC names a file whose first four bytes (an int32 in host order) count down the
 * allocations gpxd makes (malloc, calloc, realloc, and what libc makes through them, such as
 * strdup): the one that takes the count from 1 to 0 returns NULL with errno ENOMEM, and every
 * other is served by libc.  The test writes the count through its own mapping of the file and
 * reads it back to learn whether that allocation came.  Without GPX_FAILALLOC nothing fails.
 * Allocations the NVIDIA driver's libraries make themselves are neither failed nor counted:
 * the driver is not gpxd, and on an H100 (driver 580.159.04) one failed inside
 * cuMemHostRegister crashed the driver itself.  Nor, for the cluster's calls to etcd, are
 * those json-c's parser makes, nor libcurl's own while it drives transfers
 * (curl_multi_socket_action): gpxd cannot check inside them, and there json-c 0.16 handed a
 * name that found no memory on to strlen, and libcurl 7.88 died of a division by zero.
 * Should gpxd die of a fault meanwhile, its
 * stack goes to its stderr (the test's log of it).
 */
#include "config.h"

#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <signal.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

static _Atomic int32_t *countdown;

static void
on_fault(int sig)
{
	static const char head[] = "failalloc: gpxd died of a fault; its stack:\n";
	void *frames[64];
	int n = backtrace(frames, 64);

	if (write(2, head, sizeof(head) - 1) > 0)
		backtrace_symbols_fd(frames, n, 2);
	signal(sig, SIG_DFL);
	raise(sig);
}

__attribute__((constructor)) static void
failalloc_init(void)
{
	const char *path = getenv("GPX_FAILALLOC");
	void *frames[1];
	void *m;
	int fd;

	if (path == NULL || (fd = open(path, O_RDWR | O_CLOEXEC)) < 0)
		return;
	backtrace(frames, 1);            /* (loads what backtrace needs now, not in the handler) */
	signal(SIGSEGV, on_fault);
	signal(SIGBUS, on_fault);
	signal(SIGFPE, on_fault);
	signal(SIGABRT, on_fault);
	m = mmap(NULL, sizeof(*countdown), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m != MAP_FAILED)
		countdown = m;
}

/* Whether code at caller is the NVIDIA driver's (libcuda, libnvidia-*). */
static bool
from_driver(const void *caller)
{
	Dl_info i;

	return dladdr(caller, &i) != 0 && i.dli_fname != NULL &&
	    (strstr(i.dli_fname, "libcuda") != NULL || strstr(i.dli_fname, "libnvidia") != NULL);
}

/* Whether the function fn runs below (only asked while armed: a walk of the stack). */
static bool
under(const char *fn)
{
	void *frames[48];
	int n = backtrace(frames, 48);
	Dl_info i;

	for (int k = 2; k < n; k++)
		if (dladdr(frames[k], &i) != 0 && i.dli_sname != NULL && strcmp(i.dli_sname, fn) == 0)
			return true;
	return false;
}

/* Whether code at caller is in the library named lib. */
static bool
from_lib(const void *caller, const char *lib)
{
	Dl_info i;

	return dladdr(caller, &i) != 0 && i.dli_fname != NULL && strstr(i.dli_fname, lib) != NULL;
}

/* Whether this allocation, made by code at caller, is the one to fail. */
static bool
fail_now(const void *caller)
{
	int32_t v;

	if (countdown == NULL || (v = atomic_load(countdown)) <= 0 || from_driver(caller) ||
	    under("json_tokener_parse_ex") || (from_lib(caller, "libcurl") && under("curl_multi_socket_action")))
		return false;
	while (v > 0)
		if (atomic_compare_exchange_weak(countdown, &v, v - 1))
			return v == 1;
	return false;
}

void *
malloc(size_t n)
{
	if (fail_now(__builtin_return_address(0))) {
		errno = ENOMEM;
		return NULL;
	}
	return __libc_malloc(n);
}

void *
calloc(size_t n, size_t size)
{
	if (fail_now(__builtin_return_address(0))) {
		errno = ENOMEM;
		return NULL;
	}
	return __libc_calloc(n, size);
}

void *
realloc(void *p, size_t n)
{
	if (fail_now(__builtin_return_address(0))) {
		errno = ENOMEM;
		return NULL;
	}
	return __libc_realloc(p, n);
}
