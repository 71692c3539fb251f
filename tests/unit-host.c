/*
 * Unit tests of the host path's copy (daemon/host/mem-host.c): large jobs are copied with
 * non-temporal stores in one of two orders, chosen by timing both on the first chunks; either
 * order copies every byte, whatever the alignment, and nothing outside the range.
 */
#include "config.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "daemon/host/host.h"
#include "tests/tap.h"
#include "tests/unit.h"

#define BUF (8u << 20)

/* dst[doff..doff+len) equals src[soff..]; the bytes around it still hold 0xee. */
static bool
copied(const unsigned char *src, size_t soff, const unsigned char *dst, size_t doff, size_t len)
{
	for (size_t i = 0; i < doff; i++)
		if (dst[i] != 0xee)
			return false;
	for (size_t i = doff + len; i < BUF; i++)
		if (dst[i] != 0xee)
			return false;
	return memcmp(dst + doff, src + soff, len) == 0;
}

void
test_host_copy(void)
{
#if !defined(__x86_64__)
	tap_skip(5, "mem_host_copy streams only on x86-64 (memmove elsewhere)");
	return;
#endif
	static const struct {
		size_t soff, doff, len;
	} cases[] = {
		{ 0, 0, 4u << 20 },                /* aligned, whole lines */
		{ 17, 3, (4u << 20) + 77 },        /* a head and a tail around the streamed body */
		{ 64, 5, (1u << 20) + 1 },
		{ 4096, 4096 + 63, 4096 },         /* the least piece streamed */
	};
	unsigned char *src = mmap(NULL, BUF, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	unsigned char *dst = mmap(NULL, BUF, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	uint32_t x = 12345;

	if (src == MAP_FAILED || dst == MAP_FAILED)
		tap_bail("mmap");
	for (size_t i = 0; i < BUF; i++)
		src[i] = (unsigned char)((x = x * 1103515245u + 12345u) >> 16);
	for (int way = 0; way < 2; way++) {
		mem_host_nt_way(way);
		bool all = true;
		for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
			memset(dst, 0xee, BUF);
			mem_host_copy(dst + cases[k].doff, src + cases[k].soff, cases[k].len, UINT64_MAX);
			all = all && copied(src, cases[k].soff, dst, cases[k].doff, cases[k].len);
		}
		ok(all, "mem_host_copy, non-temporal stores %s: every byte, any alignment, nothing outside",
		    mem_host_nt_order());
	}

	/* Undecided: the first chunks of large jobs time both orders, then one is kept. */
	mem_host_nt_way(-1);
	ok(mem_host_nt_order() == NULL, "mem_host_nt_way(-1): no order chosen");
	bool all = true;
	for (int i = 0; i < 16; i++) {
		memset(dst, 0xee, BUF);
		mem_host_copy(dst + 1, src + 2, 2u << 20, UINT64_MAX);
		all = all && copied(src, 2, dst, 1, 2u << 20);
	}
	ok(all, "the timed chunks are copied whole, by either order");
	ok(mem_host_nt_order() != NULL, "after 16 timed chunks of 2 MiB an order is chosen: %s",
	    mem_host_nt_order() ? mem_host_nt_order() : "none");
	munmap(src, BUF);
	munmap(dst, BUF);
}
