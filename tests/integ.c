/*
 * Integration tests against a real gpxd (started by harness.c on a private socket): clients
 * through libgpxclient moving checksummed data between memfds, single and vectored (up to
 * 65,536 segments), sharing buffers through exports, and every refusal the daemon owes them:
 * bounds, foreign region ids, export rules, read-only exports, credits, wrong descriptors.
 * Where libgpxclient cannot produce the bad input (wrong version, message before Hello,
 * oversized datagrams, too many descriptors, a corrupted ring) the test speaks the wire
 * protocol directly.  After each part the daemon's descriptor count must come back to what it
 * was, and at the end gpxd must stop cleanly on SIGTERM.
 *
 * Correctness never depends on timing: waits have generous limits and only turn a hang into a
 * failure; where a race decides between two legal outcomes (a cancel), both are accepted and
 * checked for what each promises.
 *
 * This file starts gpxd and runs the parts in order; the parts live in files by area
 * (tests/integ.h names them).
 */
#include "config.h"

#include "tests/harness.h"
#include "tests/integ.h"
#include "tests/tclient.h"
#include "tests/tap.h"

struct harness H;

int
daemon_fds_settle(int want)
{
	return harness_wait_fds(&H, want, WAIT_MS);
}

int
main(void)
{
	start_gpxd_with("[daemon]\nmetrics = 127.0.0.1:0\n");    /* (its counters: test_doorbell_together) */
	diag("gpxd pid %d on %s, %d descriptors at baseline", (int)H.pid, H.sock, H.baseline);

	test_concurrent();
	test_big_vector();
	test_bounds();
	test_pages();
	test_pages_table();
	test_area_faulted();
	test_foreign_region();
	test_exports();
	test_revoke_running();
	test_export_rules();
	test_cancel();
	test_credits_lib();
	test_credits_raw();
	test_transfer_flags();
	test_nonblocking_socket();
	test_refusal_reason_kept();
	test_sq_order();
	test_sq_held_kill();
	test_disconnect();
	test_bad_fds();
	test_protocol();
	test_doorbell();
	test_doorbell_together();
	test_backlog_doorbell();
	test_host_wake_after_spin();
	test_idle_sleeps();
	test_limits();

	ok(daemon_fds_settle(H.baseline) == H.baseline, "at the end gpxd holds exactly its baseline descriptors");
	test_stop_drains_queue();
	test_stop_restart();
	return finish();
}
