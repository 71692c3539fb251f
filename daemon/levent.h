/*
 * levent.c, the top of gpxd, as main.c sees it: the event loop, the listening socket,
 * signals, timers, the start of every layer in order and its stop.
 */
#ifndef GPX_LEVENT_H
#define GPX_LEVENT_H

#include "daemon/gpxd.h"

/* What the command line fixed, which a reload keeps (main.c). */
struct gpxd_args {
	const char *socket;          /* -s, or NULL */
	bool log_fixed;              /* -d or -D: the log level is the command line's */
};
int levent_run(const struct gpxd_args *);

#endif
