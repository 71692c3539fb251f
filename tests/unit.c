/*
 * Unit tests of gpxd's internals, linked against the daemon's own library (libgpxd.la): the
 * configuration parser, export names and rules, the framing and fd passing of proto/wire.c,
 * the bounded unpack arena, region lifetimes (use, revoke, the mapping closed by the last
 * user), the completion queue's credits, doorbell and broken-client detection, the check of
 * segment lists and the engine's cutting of jobs into chunks.
 *
 * This file runs the parts, which live in unit-*.c by area (tests/unit.h names them).
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>

#include "daemon/gpxd.h"
#include "tests/tap.h"
#include "tests/unit.h"

char tmpdir[64];

int
main(void)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	log_init(LOG_L_ERR, NULL, false);
	snprintf(tmpdir, sizeof(tmpdir), "%s/gpx-unit.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
	if (mkdtemp(tmpdir) == NULL)
		tap_bail("mkdtemp");

	test_conf();
	test_exports();
	test_wire();
	test_arena();
	test_region();
	test_cq();
	test_host_copy();
	test_xfer_check();
	test_engine_chunks();
	test_engine_small_first();
	test_pool_shares();

	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
	(void)!system(cmd);
	return tap_done();
}
