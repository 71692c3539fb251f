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
 */
#ifndef GPX_TESTS_FUZZ_H
#define GPX_TESTS_FUZZ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum { FUZZ_FD_EVENTFD, FUZZ_FD_MEMFD, FUZZ_FD_PIPE, FUZZ_FD_UNSEALED };
#define FUZZ_MEMFD_SIZE 65536
#define FUZZ_OVERSIZE 0xffff

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Descriptors the last input left open in the process (0 when all is well). */
extern int fuzz_leaked;
/* Abort on a leak (the libFuzzer build); the replay reports it instead. */
extern bool fuzz_abort_on_leak;

#endif
