/*
 * The parts of the unit tests, by area; tests/unit.c runs them in this order.
 */
#ifndef GPX_TESTS_UNIT_H
#define GPX_TESTS_UNIT_H

/* A private temporary directory for the test's files, removed at the end. */
extern char tmpdir[64];

/* tests/unit-conf.c */
void test_conf(void);
void test_exports(void);
/* tests/unit-wire.c */
void test_wire(void);
void test_arena(void);
/* tests/unit-region.c */
void test_region(void);
void test_cq(void);
/* tests/unit-host.c */
void test_host_copy(void);
/* tests/unit-xfer.c */
void test_xfer_check(void);
void test_engine_chunks(void);
void test_engine_small_first(void);
void test_pool_shares(void);

#endif
