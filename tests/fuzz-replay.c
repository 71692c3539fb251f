/*
 * Replays the fuzz corpus (tests/corpus, or the directory given) through the fuzz target of
 * fuzz-decode.c, one TAP check per file: the input ran to its end and left no descriptor open.
 * This is how `make check` exercises what `make fuzz` found, without clang or libFuzzer.
 */
#include "config.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/gpxd.h"
#include "daemon/client/client.h"
#include "daemon/engine/engine.h"
#include "tests/fuzz.h"
#include "tests/tap.h"

static int
is_file(const struct dirent *e)
{
	return e->d_name[0] != '.';
}

int
main(int argc, char **argv)
{
	char dir[4096], path[8192];
	struct dirent **list;
	int n;

	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc > 1)
		snprintf(dir, sizeof(dir), "%s", argv[1]);
	else
		snprintf(dir, sizeof(dir), "%s/tests/corpus", getenv("GPX_SRCDIR") ? getenv("GPX_SRCDIR") : ".");
	if ((n = scandir(dir, &list, is_file, alphasort)) < 0)
		tap_bail("cannot read the corpus in %s", dir);
	if (n == 0)
		tap_bail("the corpus in %s is empty", dir);
	fuzz_abort_on_leak = false;
	for (int i = 0; i < n; i++) {
		snprintf(path, sizeof(path), "%s/%s", dir, list[i]->d_name);
		FILE *f = fopen(path, "rb");
		uint8_t *buf = NULL;
		long len = -1;
		if (f != NULL && fseek(f, 0, SEEK_END) == 0 && (len = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
		    (buf = malloc(len ? len : 1)) != NULL && fread(buf, 1, len, f) != (size_t)len)
			len = -1;
		if (f != NULL)
			fclose(f);
		if (len < 0) {
			ok(0, "corpus/%s: readable", list[i]->d_name);
		} else {
			LLVMFuzzerTestOneInput(buf, len);
			ok(fuzz_leaked == 0, "corpus/%s (%ld bytes): no descriptor left open%s", list[i]->d_name, len,
			    fuzz_leaked ? " -- LEAK" : "");
		}
		free(buf);
		free(list[i]);
	}
	free(list);
	ok(conn_count() == 0 && export_count() == 0 && engine_inflight() == 0,
	    "after the corpus: no connection, export or transfer is left in the daemon's tables");
	return tap_done();
}
