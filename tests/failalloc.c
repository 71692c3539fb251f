/*
 * Loaded into gpxd with LD_PRELOAD by tests/alloc-fail: fails one allocation when told to.
 *
 * GPX_FAILALLOC names a file whose first four bytes (an int32 in host order) count down the
 * allocations gpxd makes (malloc, calloc, realloc, and what libc makes through them, such as
 * strdup): the one that takes the count from 1 to 0 returns NULL with errno ENOMEM, and every
 * other is served by libc.  The test writes the count through its own mapping of the file and
 * reads it back to learn whether that allocation came.  Without GPX_FAILALLOC nothing fails.
 * The next four bytes, when above 0, become the count once that allocation has failed: a
 * second failure, in what the first sets off (a key of the cluster's watch that found no
 * memory has every key read again), with no race between the two.
 * Allocations the NVIDIA driver's libraries make themselves are neither failed nor counted:
 * the driver is not gpxd, and on an H100 (driver 580.159.04) one failed inside
 * cuMemHostRegister crashed the driver itself.  Nor, for the cluster's calls to etcd, are
 * those json-c's parser makes, nor libcurl's own while it drives transfers
 * (curl_multi_socket_action): gpxd cannot check inside them, and there json-c 0.16 handed a
 * name that found no memory on to strlen, and libcurl 7.88 died of a division by zero.
 * Should gpxd die of a fault meanwhile, its
 * stack goes to its stderr (the test's log of it).
 *
 * With GPX_FAILALLOC_UNDER naming a function of gpxd's own, only the allocations made below
 * it (on the stack of a call to it) count and fail: the count may then be written before
 * gpxd starts, to fail allocations of its start (cluster_start) and none before or after.
 * gpxd exports no symbols, so the function is looked up in the symbol table of its file;
 * where there is none (a stripped gpxd), nothing counts and the count stays as written.
 * GPX_FAILALLOC_SKIP_UNDER names an exported function (of a library) whose allocations
 * neither count nor fail: curl_global_init, whose thousands of OpenSSL's would take most of
 * a test's time, may be left to a sample of its own.
 *
 * GPX_FAILALLOC_ALL_UNDER names an exported function (getgrnam) every allocation below which
 * fails, uncounted, while the count is above 0; nothing else counts or fails.  For what
 * recovers from one failed allocation: glibc's getgrnam finds the group all the same (it
 * reads its files again, or unbuffered), and says ENOMEM only when none can be had.
 */
#include "config.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
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
#include <sys/stat.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

static _Atomic int32_t *countdown;
static uintptr_t under_lo, under_hi;     /* GPX_FAILALLOC_UNDER's code, where it was loaded */
static bool under_set;
static uintptr_t skip_lo, skip_hi;       /* GPX_FAILALLOC_SKIP_UNDER's code */
static uintptr_t all_lo, all_hi;         /* GPX_FAILALLOC_ALL_UNDER's */

/* The load address of the program itself: the first object dl_iterate_phdr names. */
static int
program_base(struct dl_phdr_info *info, size_t size, void *arg)
{
	(void)size;
	*(uintptr_t *)arg = info->dlpi_addr;
	return 1;
}

/* Where gpxd's function fn lies, from the symbol table of /proc/self/exe (none if stripped). */
static void
find_function(const char *fn)
{
	struct stat st;
	const unsigned char *f = MAP_FAILED;
	uintptr_t base = 0;
	int fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);

	if (fd >= 0 && fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(Elf64_Ehdr))
		f = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
	if (fd >= 0)
		close(fd);
	if (f == MAP_FAILED)
		return;
	const Elf64_Ehdr *eh = (const void *)f;
	const Elf64_Shdr *sh = (const void *)(f + eh->e_shoff);
	for (int i = 0; i < eh->e_shnum && under_hi == 0; i++) {
		if (sh[i].sh_type != SHT_SYMTAB)
			continue;
		const Elf64_Sym *sym = (const void *)(f + sh[i].sh_offset);
		const char *names = (const char *)f + sh[sh[i].sh_link].sh_offset;
		for (size_t k = 0; k < sh[i].sh_size / sizeof(*sym) && under_hi == 0; k++)
			if (ELF64_ST_TYPE(sym[k].st_info) == STT_FUNC && sym[k].st_size > 0 &&
			    strcmp(names + sym[k].st_name, fn) == 0) {
				dl_iterate_phdr(program_base, &base);
				under_lo = base + sym[k].st_value;
				under_hi = under_lo + sym[k].st_size;
			}
	}
	munmap((void *)f, (size_t)st.st_size);
}

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

/* Where the exported function fn lies (its range found once: a walk of the stack that asks
 * dladdr of each frame, at each of curl_global_init's thousands of allocations, takes seconds). */
static void
find_exported(const char *fn, uintptr_t *lo, uintptr_t *hi)
{
	void *p = dlsym(RTLD_DEFAULT, fn);
	const ElfW(Sym) *sym = NULL;
	Dl_info i;

	if (p != NULL && dladdr1(p, &i, (void **)&sym, RTLD_DL_SYMENT) != 0 && sym != NULL) {
		*lo = (uintptr_t)p;
		*hi = *lo + sym->st_size;
	}
}

__attribute__((constructor)) static void
failalloc_init(void)
{
	const char *path = getenv("GPX_FAILALLOC"), *fn = getenv("GPX_FAILALLOC_UNDER"), *skip;
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
	if ((skip = getenv("GPX_FAILALLOC_SKIP_UNDER")) != NULL)
		find_exported(skip, &skip_lo, &skip_hi);
	if ((skip = getenv("GPX_FAILALLOC_ALL_UNDER")) != NULL)
		find_exported(skip, &all_lo, &all_hi);
	if (fn != NULL) {
		under_set = true;
		find_function(fn);
	}
	m = mmap(NULL, 2 * sizeof(*countdown), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
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

/*
 * Whether this allocation may count under GPX_FAILALLOC_UNDER and GPX_FAILALLOC_SKIP_UNDER:
 * a frame of the stack in the one's code, none in the other's (only asked while armed).
 */
static bool
under_function(void)
{
	void *frames[64];
	int n = backtrace(frames, 64);
	bool in = !under_set;

	for (int k = 2; k < n; k++) {
		uintptr_t f = (uintptr_t)frames[k];
		if (f >= skip_lo && f < skip_hi)
			return false;
		in = in || (f >= under_lo && f < under_hi);
	}
	return in;
}

/* Whether a frame of the stack lies in GPX_FAILALLOC_ALL_UNDER's function. */
static bool
under_all(void)
{
	void *frames[32];
	int n = backtrace(frames, 32);

	for (int k = 2; k < n; k++)
		if ((uintptr_t)frames[k] >= all_lo && (uintptr_t)frames[k] < all_hi)
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

	if (countdown != NULL && all_hi != 0)
		return atomic_load(countdown) > 0 && under_all();
	if (countdown == NULL || (v = atomic_load(countdown)) <= 0 ||
	    ((under_set || skip_hi != 0) && !under_function()) || from_driver(caller) ||
	    under("json_tokener_parse_ex") || (from_lib(caller, "libcurl") && under("curl_multi_socket_action")))
		return false;
	while (v > 0)
		if (atomic_compare_exchange_weak(countdown, &v, v - 1)) {
			if (v == 1)
				atomic_store(countdown, atomic_exchange(&countdown[1], 0));   /* the second, if any */
			return v == 1;
		}
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
