/*
 * Internal interface between the parts of libgpxclient (not installed).
 */
#ifndef GPX_CLIENT_H
#define GPX_CLIENT_H

#include "client-lib/gpx.h"
#include "proto/gpx.pb-c.h"
#include "proto/ring.h"

int client_register(gpx_conn *c, Gpx__Register *reg, int fd, gpx_region *out);
/*
 * A VMM Register naming the n pieces under its range (proto/ring.h struct gpx_wire_piece).
 * -GPX_ENOENT with *nmissing > 0: the daemon lacks those pieces (indexes into pieces, in
 * missing[], which holds GPX_MISSING_MAX): send them with client_send_pieces and ask again.
 */
int client_register_pieces(gpx_conn *c, Gpx__Register *reg, const struct gpx_wire_piece *pieces, size_t n,
    gpx_region *out, uint32_t *missing, size_t *nmissing);
/* Pieces of a reservation with their fds (at most GPX_PIECES_MAX); the fds are not taken. */
int client_send_pieces(gpx_conn *c, const uint8_t uuid[16], uint64_t res, uint64_t res_size,
    const struct gpx_wire_piece *pieces, const int *fds, size_t n);
int client_error(gpx_conn *c, int code, const char *msg);

#endif
