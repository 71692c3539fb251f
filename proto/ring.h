/*
 * Shared-memory layouts between gpxd and libgpxclient.
 *
 * The completion ring: a memfd created and sealed by the daemon (it can neither shrink nor
 * grow), mapped by both sides.  The daemon is the only producer: it fills the record at
 * head % entries and then publishes head with a release store.  The client is the only
 * consumer: it reads records up to head (acquire) and publishes tail (release).  Everything the
 * client writes (tail) is untrusted by the daemon: a tail that runs ahead of head or falls more
 * than `entries` behind it marks the client as broken and it is disconnected.
 *
 * The submission queue, in the same memfd after the completion records: single-segment
 * transfers the client writes for the daemon to pick up without a socket message.  The client
 * is its only producer (sq_tail), the daemon its only consumer (sq_head).  While the daemon's
 * loop is busy polling it reads the queue on every turn; before it sleeps it sets sq_wakeup,
 * and a client that finds sq_wakeup set after publishing an entry sends an SqKick message.
 * Each entry is read once into private memory and checked like any Transfer message.
 *
 * The doorbell: after publishing records the daemon writes the client's eventfd, unless
 * cq_spinners says a thread of the client is looking at the ring right now (a wait's spin).
 * A spinner raises it before it looks and lowers it before it sleeps, then looks once more;
 * the daemon publishes head before it reads cq_spinners, both with a full fence between, so
 * a record is always either seen by that last look or followed by a doorbell.  Connections
 * that brought their own eventfd never raise it: they get one doorbell per record.  The
 * daemon only reads it; a client that lies about it only misses its own doorbells.
 * cq_sleepers: a thread of the client raises it while it sleeps in a wait (with the library's
 * own eventfd only); the daemon then may write the eventfd with no record, a little before a
 * long transfer's record is due, so that the thread spins again when the record comes instead
 * of paying a wake-up after it (zero, never raised, from clients before it was added).  The
 * daemon only reads it: a client that lies about it gets at most one early write per transfer.
 *
 * The segment lists of large vectored transfers: struct gpx_wire_seg records in the
 * connection's segment area (or a memfd of its own); the page lists of page transfers
 * (Transfer.page_size set): struct gpx_wire_page records in the segment area; the pairs of
 * a batch (Transfer.pair_count): struct gpx_wire_pair records; the pieces of a VMM range
 * (Register.piece_count): struct gpx_wire_piece records.
 */
#ifndef GPX_RING_H
#define GPX_RING_H

#include <stdint.h>

#define GPX_RING_MAGIC 0x67707872u /* "gpxr" */
#define GPX_RING_VERSION 4

struct gpx_ring_hdr {
	uint32_t magic;
	uint32_t version;
	uint32_t entries;      /* a power of two */
	uint32_t entry_size;   /* sizeof(struct gpx_cqe) */
	uint8_t pad0[48];
	uint64_t head;         /* daemon: records published */
	uint8_t pad1[56];
	uint64_t tail;         /* client: records consumed */
	uint8_t pad2[56];
	uint64_t dropped;      /* daemon: notifications dropped because the ring was full */
	uint8_t pad3[56];
	uint64_t segs_consumed; /* daemon: Transfers naming the segment area it has handled */
	uint8_t pad4[56];
	uint64_t sq_tail;      /* client: submissions published */
	uint8_t pad5[56];
	uint64_t sq_head;      /* daemon: submissions taken */
	uint32_t sq_wakeup;    /* daemon: set while it does not poll; the client must kick */
	uint8_t pad6[52];
	uint32_t cq_spinners;  /* client: threads looking at the ring now; no doorbell needed */
	uint32_t cq_sleepers;  /* client: threads asleep until its eventfd is written */
	uint8_t pad7[56];
};

/* One submission: a single-segment transfer. */
struct gpx_sqe {
	uint64_t tag;
	uint64_t src_region;
	uint64_t dst_region;
	uint64_t src_offset;
	uint64_t dst_offset;
	uint64_t length;
	uint32_t flags;        /* as Transfer.flags: none defined yet, any bit set is refused */
	uint32_t pad;
	uint64_t pad2;
};

/* One completion (or notification) record. */
struct gpx_cqe {
	uint64_t tag;
	uint64_t bytes;        /* bytes moved */
	int32_t status;        /* gpx.Status: 0 or a positive code */
	uint32_t flags;        /* GPX_CQE_* */
	uint64_t region;       /* notifications: the owner's region that was written */
};

#define GPX_CQE_NOTIFY 0x1u   /* a copy by another client into an exported region finished */

struct gpx_wire_seg {
	uint64_t src_offset;
	uint64_t dst_offset;
	uint64_t length;
};

/* A page transfer's pair: page src of the source to page dst of the destination. */
struct gpx_wire_page {
	uint32_t src;
	uint32_t dst;
};

/* A piece of VMM memory under a registered range (Register.piece_count). */
struct gpx_wire_piece {
	uint64_t id;           /* the driver's memory block id of the physical allocation */
	uint64_t offset;       /* where it is mapped, from the reservation's start */
	uint64_t size;
};

/* One pair of a batch (Transfer.pair_count). */
struct gpx_wire_pair {
	uint64_t src_region;
	uint64_t dst_region;
	uint64_t src_offset;   /* added to the offsets of its segments, or its pages' base */
	uint64_t dst_offset;
	uint32_t seg_first;    /* segments: its run of the request's list; pages: 0 */
	uint32_t seg_count;
};

static inline uint64_t
gpx_ring_size(uint32_t entries)
{
	return sizeof(struct gpx_ring_hdr) + (uint64_t)entries * (sizeof(struct gpx_cqe) + sizeof(struct gpx_sqe));
}

/* Where submission entry idx lies, from the ring's start: after the header and the cqes. */
static inline uint64_t
gpx_sq_offset(uint32_t entries, uint64_t idx)
{
	return sizeof(struct gpx_ring_hdr) + (uint64_t)entries * sizeof(struct gpx_cqe) +
	    (idx & (entries - 1)) * sizeof(struct gpx_sqe);
}

static inline struct gpx_sqe *
gpx_sq_slot(struct gpx_ring_hdr *h, uint32_t entries, uint64_t idx)
{
	return (struct gpx_sqe *)((char *)h + gpx_sq_offset(entries, idx));
}

static inline struct gpx_cqe *
gpx_ring_slot(struct gpx_ring_hdr *h, uint64_t idx)
{
	return (struct gpx_cqe *)(h + 1) + (idx & (h->entries - 1));
}

#endif
