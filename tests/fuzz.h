/*
 * The fuzz target of gpxd's message decoder and dispatcher (fuzz-decode.c), shared by the
 * libFuzzer build (`make fuzz`) and by fuzz-replay.c, which runs the committed corpus in
 * `make check`.
 *
 * An input is a sequence of frames, each sent as one datagram to a fresh connection:
 *   u8 flags   bits 0-1: how many fds ride along (0-3; 3 is more than any message takes),
 *              bits 2-3, 4-5, 6-7: the kind of fd 1, 2, 3 (FUZZ_FD_*)
 *   u16 len    little-endian payload length; 0xffff: no payload, GPX_MSG_MAX + 1 zero bytes are sent
 *   payload
 * Region ids below 2^32 (and a Drain of client 0) are rewritten to the connection's own epoch
 * (client id), so that the fuzzer reaches the handlers behind the id checks.
 *
 * Two flags with no fd write shared memory instead, as a client may at any moment; the
 * payload is a little-endian u32 offset, then the bytes, written from that offset (modulo the
 * memory's size, and cut at its end):
 *   FUZZ_POKE_AREA  into the segment area of the last SegArea (its FUZZ_FD_MEMFD): the pairs,
 *                   segments, page lists and VMM pieces that Transfers and Registers name there
 *   FUZZ_POKE_RING  into the connection's ring (its Welcome's memfd): the header's fields, the
 *                   submission queue, the completions; then the queues are polled once, as
 *                   gpxd's loop does while clients are busy
 * Region ids below 2^32 are rewritten there too: in the submissions between the ring's sq_head
 * and sq_tail, and in the pairs of the segment area that a Transfer names, before it goes.
 * (Other kind bits with no fd are ignored.)
 */
#ifndef GPX_TESTS_FUZZ_H
#define GPX_TESTS_FUZZ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum { FUZZ_FD_EVENTFD, FUZZ_FD_MEMFD, FUZZ_FD_PIPE, FUZZ_FD_UNSEALED };
#define FUZZ_MEMFD_SIZE 65536
#define FUZZ_POKE_AREA 0x04
#define FUZZ_POKE_RING 0x08
#define FUZZ_OVERSIZE 0xffff

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Descriptors the last input left open in the process (0 when all is well). */
extern int fuzz_leaked;
/* Abort on a leak (the libFuzzer build); the replay reports it instead. */
extern bool fuzz_abort_on_leak;

#endif
