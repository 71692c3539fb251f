/*
 * Framing shared by gpxd and libgpxclient: one protobuf-c envelope per SOCK_SEQPACKET datagram,
 * file descriptors as SCM_RIGHTS, a hard size cap checked before anything is allocated, and a
 * bounded arena allocator for unpacking so a message can never make the receiver allocate more
 * than a fixed multiple of the cap.
 */
#ifndef GPX_WIRE_H
#define GPX_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <protobuf-c/protobuf-c.h>

#define GPX_PROTO_VERSION 4            /* 2: page transfers (Transfer.page_size); 3: VMM
                                        * pieces (Register.piece_count, Pieces), batches
                                        * (Transfer.pair_count); 4: page lists in GPU memory
                                        * (Transfer.list_region) */
#define GPX_PROTO_MIN 1                /* the oldest a daemon still speaks */
#define GPX_MSG_MAX (64 * 1024)        /* largest datagram either side sends or accepts */
#define GPX_MAX_FDS 32                 /* most fds any message carries (Pieces) */
#define GPX_PIECES_MAX GPX_MAX_FDS     /* pieces of one Pieces message */
#define GPX_MISSING_MAX 1024           /* indexes in one Reply.missing */
#define GPX_PAIRS_MAX 16384            /* pairs in one batch (as client-lib/gpx.h says) */
#define GPX_ARENA_SIZE (16 * GPX_MSG_MAX)
#define GPX_DEFAULT_SOCKET "/run/gpx/gpxd.sock"
#define GPX_AREA_MAX (256u << 20)     /* largest segment area a connection may map */

/* Bounded bump allocator handed to protobuf-c's unpack; free is a no-op, reset between messages. */
struct wire_arena {
	ProtobufCAllocator pa;
	size_t used;
	size_t cap;
	int failed;
	_Alignas(16) unsigned char buf[];
};

struct wire_arena *wire_arena_new(size_t cap);
void wire_arena_reset(struct wire_arena *);

/* Sends one datagram with up to GPX_MAX_FDS fds.  Returns 0 or -errno. */
int wire_send(int sock, const void *buf, size_t len, const int *fds, int nfds);

/* Packs msg and sends it; -EMSGSIZE if it packs larger than GPX_MSG_MAX. */
int wire_send_msg(int sock, const ProtobufCMessage *msg, const int *fds, int nfds);

/*
 * Receives one datagram into buf (which must hold GPX_MSG_MAX bytes) and its fds (close-on-exec).
 * Returns the length, 0 on EOF (or an empty datagram), or -errno: -EAGAIN, -EMSGSIZE for a
 * truncated datagram, -EBADMSG for foreign control data or more fds than its room for them
 * (WIRE_CMSG_FDS), -EMFILE for fds the kernel could not give this process (its descriptor
 * limit), -E2BIG for more than maxfds fds.  On 0 and on every error all received fds are
 * closed and *nfds is 0.  With -EBADMSG, -EMFILE and -E2BIG the bytes came whole: *len (if
 * len is not NULL) is their number, so that the message can be answered.
 */
ssize_t wire_recv(int sock, void *buf, size_t *len, int *fds, int *nfds, int maxfds, int flags);

void wire_close_fds(int *fds, int nfds);

#endif
