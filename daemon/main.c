/*
 * gpxd: command line, configuration, then the event loop (levent.c).
 */
#include "config.h"

#include <getopt.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "levent.h"
#include "client/client.h"
#include "cluster/cluster.h"

static void
usage(int status)
{
	fprintf(status ? stderr : stdout,
	    "usage: gpxd [-dfhV] [-c file] [-D subsystems] [-s socket]\n"
	    "  -c, --config FILE    configuration file (default " GPXD_CONF ")\n"
	    "  -s, --socket PATH    listen on PATH instead of the configured socket\n"
	    "  -f, --foreground     do not detach\n"
	    "  -d, --debug          log debug messages\n"
	    "  -D, --debug-only S   with -d, only these comma-separated subsystems\n"
	    "  -V, --version        print the version and exit\n"
	    "  -h, --help           this text\n");
	exit(status);
}

int
main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{ "config", required_argument, NULL, 'c' },
		{ "socket", required_argument, NULL, 's' },
		{ "foreground", no_argument, NULL, 'f' },
		{ "debug", no_argument, NULL, 'd' },
		{ "debug-only", required_argument, NULL, 'D' },
		{ "version", no_argument, NULL, 'V' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	const char *conf_path = NULL, *subsys = NULL;
	struct gpxd_args args = { 0 };
	char *path = NULL;
	bool foreground = false, debug = false;
	char err[512];
	int ch;

	while ((ch = getopt_long(argc, argv, "c:s:fdD:Vh", longopts, NULL)) != -1) {
		switch (ch) {
		case 'c': conf_path = optarg; break;
		case 's': args.socket = optarg; break;
		case 'f': foreground = true; break;
		case 'd': debug = true; break;
		case 'D': subsys = optarg; break;
		case 'V': printf("gpxd %s (protocol %d)\n", GPXD_VERSION, GPX_PROTO_VERSION); return 0;
		case 'h': usage(0); break;
		default: usage(2);
		}
	}
	if (optind != argc)
		usage(2);

	/*
	 * Segment lists of large vectored transfers are allocated and freed per request: keep such
	 * blocks in the heap instead of fresh mappings, so that the next request does not fault
	 * its pages in again.
	 */
	mallopt(M_MMAP_THRESHOLD, 64 << 20);
	mallopt(M_TRIM_THRESHOLD, 128 << 20);
	log_init(debug ? LOG_L_DEBUG : LOG_L_INFO, subsys, sdn_journal_wanted());
	/* -d and -D decide the log at start and at every reload: the file's log_level is not used. */
	args.log_fixed = debug || subsys != NULL;
	/* The daemon changes directory to /: a reload must read the file this start read. */
	if (conf_path != NULL && (path = conf_abspath(conf_path)) == NULL)
		fatal("%s", conf_path);
	cluster_conf_register();
	conf_metrics_check(metrics_check);
	if ((cfg = conf_new()) == NULL)
		fatalx("out of memory");
	if (path != NULL || access(GPXD_CONF, F_OK) == 0) {
		if (conf_load(cfg, path ? path : GPXD_CONF, err, sizeof(err)) < 0)
			fatalx("%s", err);
	}
	free(path);
	if (!args.log_fixed && log_set_level(cfg->log_level) < 0)
		fatalx("log_level '%s': use error, warning, info or debug", cfg->log_level);
	if (!foreground && !sdn_supervised() && !sdn_journal_wanted() && daemon(0, 1) < 0)
		fatal("daemon");
	int r = levent_run(&args);
	conf_drop(cfg);
	return r;
}
