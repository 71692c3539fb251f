/*
 * The RDMA transport without rdma-core (configure found no libibverbs/librdmacm, or
 * --with-rdma=no): the interface of internal.h, built instead of rdma-*.c, saying why there is
 * nothing behind it.  The fabric then moves every byte over tcp; [fabric] transport = rdma
 * refuses to start.
 */
#include "config.h"

#include <stdio.h>
#include <string.h>

#include "daemon/fabric/internal.h"

int
fabric_rdma_init(struct event_base *b, char *why, size_t whylen)
{
	(void)b;
	snprintf(why, whylen, "this gpxd was built without rdma-core%s",
	    strcmp(cfg->fabric_transport, "rdma") == 0 ? "" : ": tcp");
	return strcmp(cfg->fabric_transport, "rdma") == 0 ? -1 : 0;
}
void fabric_rdma_shutdown(void) {}
bool fabric_rdma_offer(struct peer *p, uint32_t *port, uint8_t token[FABRIC_RDMA_TOKEN],
    struct peer_rdev devs[FABRIC_RDMA_DEVS], size_t *ndevs)
{ (void)p; (void)port; (void)token; (void)devs; *ndevs = 0; return false; }
void fabric_rdma_connect(struct peer *p, uint32_t port, const uint8_t *token, size_t tokenlen,
    const struct peer_rdev *devs, size_t ndevs)
{ (void)p; (void)port; (void)token; (void)tokenlen; (void)devs; (void)ndevs; }
void fabric_rdma_peer_down(struct peer *p) { (void)p; }
uint32_t fabric_rdma_qps(const struct peer *p) { (void)p; return 0; }
uint32_t fabric_rdma_regs(const struct peer *p) { (void)p; return 0; }
const char *fabric_rdma_device(void) { return NULL; }
bool fabric_rdma_export(struct peer *p, struct phandle *h, uint64_t *addr, uint32_t rkeys[FABRIC_RDMA_DEVS])
{ (void)p; (void)h; (void)addr; (void)rkeys; return false; }
void fabric_rdma_unexport(struct phandle *h) { (void)h; }
void fabric_rdma_region_gone(struct region *r) { (void)r; }
int fabric_rdma_post(struct peer *p, uint64_t id, bool write, struct region *local, uint64_t off, uint64_t len,
    uint64_t raddr, const uint32_t rkeys[FABRIC_RDMA_DEVS], const struct fabric_note *note)
{ (void)p; (void)id; (void)write; (void)local; (void)off; (void)len; (void)raddr; (void)rkeys; (void)note; return -1; }
int fabric_rdma_note(struct peer *p, uint64_t id, const struct fabric_note *note)
{ (void)p; (void)id; (void)note; return -1; }
void fabric_rdma_drain(void) {}
void fabric_rdma_gpu_regs(uint64_t *dmabuf, uint64_t *peermem, uint64_t *none)
{ *dmabuf = *peermem = *none = 0; }

