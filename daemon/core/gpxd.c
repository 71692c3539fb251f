/*
 * What every layer may read of the daemon itself: its clock, when it started, the socket it
 * serves.  levent.c sets the last two at start, before any client is admitted.
 */
#include "config.h"

#include <time.h>

#include "daemon/gpxd.h"

double gpxd_start_time;
const char *gpxd_socket_path = "";

double
now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}
