/*
 * Internal interface between the parts of libgpxclient (not installed).
 */
#ifndef GPX_CLIENT_H
#define GPX_CLIENT_H

#include "client-lib/gpx.h"
#include "proto/gpx.pb-c.h"

int client_register(gpx_conn *c, Gpx__Register *reg, int fd, gpx_region *out);
int client_error(gpx_conn *c, int code, const char *msg);

#endif
