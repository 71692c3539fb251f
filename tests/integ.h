/*
 * The parts of the integration tests, by area; tests/integ.c starts gpxd (H) and runs them in
 * this order, every part against the same daemon, whose descriptor count the parts check.
 */
#ifndef GPX_TESTS_INTEG_H
#define GPX_TESTS_INTEG_H

/* Waits until gpxd (H) holds want descriptors; returns its last count. */
int daemon_fds_settle(int want);

/* tests/integ-copy.c: copies and their bounds */
void test_concurrent(void);
void test_big_vector(void);
void test_bounds(void);
void test_pages(void);
void test_pages_table(void);
void test_area_faulted(void);

/* tests/integ-share.c: region ids, exports and imports, export rules */
void test_foreign_region(void);
void test_exports(void);
void test_revoke_running(void);
void test_export_rules(void);

/* tests/integ-ring.c: cancel, credits, the ring, the doorbell */
void test_cancel(void);
void test_credits_lib(void);
void test_credits_raw(void);
void test_transfer_flags(void);
void test_nonblocking_socket(void);
void test_refusal_reason_kept(void);
void test_sq_order(void);
void test_sq_held_kill(void);
void test_doorbell(void);
void test_doorbell_together(void);
void test_backlog_doorbell(void);
void test_host_wake_after_spin(void);
void test_idle_sleeps(void);

/* tests/integ-wire.c: wrong descriptors, the protocol spoken wrong */
void test_bad_fds(void);
void test_protocol(void);

/* tests/integ-life.c: disconnects, limits and the idle timeout, stop and restart */
void test_disconnect(void);
void test_limits(void);
void test_stop_restart(void);
void test_stop_drains_queue(void);

#endif
