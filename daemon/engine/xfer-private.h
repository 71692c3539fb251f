/*
 * What xfer.c (segments, batches, the segment area, jobs) and xfer-pages.c (page lists)
 * share; nothing else includes it.
 */
#ifndef GPX_XFER_PRIVATE_H
#define GPX_XFER_PRIVATE_H

#include "daemon/engine/engine.h"
#include "daemon/fabric/fabric.h"
#include "daemon/gpu/gpu.h"
#include "daemon/host/host.h"

/*
 * No region, segment or request reaches 2^62 bytes (4 EiB).  That bound lets the checking pass
 * use plain 64-bit arithmetic without a compare per segment.  Every offset, length and running
 * total goes into one OR: any of them at 2^62 or above sets one of its top two bits.  Below
 * that nothing can wrap (the total is caught before it could), and limit - offset - length,
 * with the limit below 2^62 too, has its top bit set exactly when offset + length passes the
 * limit; it goes into the OR as well.  One test of the top two bits at the end says whether
 * any segment is bad; then a second pass over the private copy finds which.
 */
#define SEG_LIMIT (1ull << 62)
#define SEG_BAD (~(SEG_LIMIT - 1))

/* A refusal in the log, within the asker's share. */
void xfer_audit(const struct xfer_from *, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/*
 * Charges bytes to the request's budgets before they are allocated; a refusal is logged.  A
 * connection without a completion ring (the unit tests' fake one) runs no transfer and is not
 * charged.
 */
int xfer_charge(struct charge *, uint64_t bytes, const struct xfer_from *, char *err, size_t errlen);

/* Bytes of a private segment array of n segments with its blocks[]. */
uint64_t xfer_segs_bytes(uint32_t n);
/*
 * The job's private segment array (j->nseg of them), with room for blocks[] after it: charged
 * on the loop thread, then allocated by whichever thread copies the list in (a long list's on
 * a task thread, so that the loop never waits for the allocator on its account).
 */
int xfer_segs_charge(struct job *, struct charge *, const struct xfer_from *, char *err, size_t errlen);
int xfer_segs_alloc(struct job *);
/* The private list a job's check still has to allocate. */
enum xfer_list { LIST_NONE, LIST_SEGS, LIST_PAGES };

/*
 * Page lists (xfer-pages.c): on the loop thread, j set up for n pages of page_size bytes for
 * each of its pairs, its private list charged (*want: the list to allocate before the check,
 * *work grows by what the check writes); then, on any thread, the records at `in` copied in and
 * checked (on_loop: the loop thread's, which may lend half of a long list to an idle GPU
 * worker).  With list, the page numbers lie in that region (GPU memory) at list_off: the
 * GPU's page kernel reads and checks them, and nothing is left to check here.
 */
int xfer_pages_prepare(struct job *, uint32_t n, uint64_t page_size, const struct region *list, uint64_t list_off,
    const struct xfer_from *, struct charge *, uint64_t *work, enum xfer_list *want, char *err, size_t errlen);
int xfer_pages_check(struct job *, const unsigned char *in, bool on_loop, char *err, size_t errlen);

#endif
