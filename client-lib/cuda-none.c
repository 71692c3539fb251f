/*
 * gpx_register_cuda() of a library built without the CUDA headers: always GPX_ENOTSUP.
 */
#include "config.h"

#include "client-lib/client.h"

__attribute__((visibility("default"))) int
gpx_register_cuda(gpx_conn *c, const void *ptr, uint64_t length, unsigned flags, gpx_region *out)
{
	(void)ptr;
	(void)length;
	(void)flags;
	(void)out;
	return client_error(c, GPX_ENOTSUP, "libgpxclient was built without CUDA support");
}
