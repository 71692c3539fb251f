/*
 * gpx-bench's targets: the rows of tests/results/TARGETS.md (its top says the format), built
 * into the program as text (tests/bench-targets-text.c, generated) or read from the file that
 * $GPX_TARGETS names, and the verdict of a figure against one of them.  A benchmark asks by id
 * and never holds a number of its own, so the file is the one place a target is written.
 */
#include "config.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/bench.h"

#define TARGETS_MAX 128

extern const unsigned char gpx_targets_text[];
extern const unsigned long gpx_targets_text_len;

static struct bench_target targets[TARGETS_MAX];
static size_t ntargets;
static bool loaded;

/* The cells of one table row "| a | b | ... |", trimmed; returns how many, or 0 for no row. */
static int
row_cells(char *line, char **cell, int max)
{
	int n = 0;
	char *p = line, *bar;

	while (isspace((unsigned char)*p))
		p++;
	if (*p++ != '|')
		return 0;
	while (n < max && (bar = strchr(p, '|')) != NULL) {
		*bar = '\0';
		while (isspace((unsigned char)*p))
			p++;
		for (char *e = bar; e > p && isspace((unsigned char)e[-1]); e--)
			e[-1] = '\0';
		cell[n++] = p;
		p = bar + 1;
	}
	return n;
}

/* An id is lower case letters, digits, '_' and '.', and starts with a letter. */
static bool
id_ok(const char *s)
{
	if (!islower((unsigned char)*s))
		return false;
	for (; *s; s++)
		if (!islower((unsigned char)*s) && !isdigit((unsigned char)*s) && *s != '_' && *s != '.')
			return false;
	return true;
}

static void
parse_line(char *line, const char *from, int lineno)
{
	char *cell[6], *end;
	struct bench_target *t;
	double v;

	/* The header row ("| id | op | ...") and rows of other shapes are not targets. */
	if (row_cells(line, cell, 6) != 5 || !id_ok(cell[0]) || strcmp(cell[1], "op") == 0)
		return;
	if ((strcmp(cell[1], ">=") != 0 && strcmp(cell[1], "<=") != 0) ||
	    (v = strtod(cell[2], &end), end == cell[2] || *end != '\0') || !*cell[3]) {
		fprintf(stderr, "gpx-bench: %s:%d: target %s: wants '>=' or '<=', a number and a "
		    "unit; ignored\n", from, lineno, cell[0]);
		return;
	}
	if (ntargets == TARGETS_MAX || bench_target(cell[0]) != NULL) {
		fprintf(stderr, "gpx-bench: %s:%d: target %s: %s; ignored\n", from, lineno, cell[0],
		    ntargets == TARGETS_MAX ? "too many targets" : "a second row for this id");
		return;
	}
	t = &targets[ntargets++];
	t->id = strdup(cell[0]);
	t->less = cell[1][0] == '<';
	t->value = v;
	t->unit = strdup(cell[3]);
	t->what = strdup(cell[4]);
}

static void
load(void)
{
	const char *path = getenv("GPX_TARGETS");
	char *text, *line, *save;
	int lineno = 0;

	loaded = true;
	if (path != NULL && *path) {
		FILE *f = fopen(path, "re");
		long len;
		if (f == NULL || fseek(f, 0, SEEK_END) < 0 || (len = ftell(f)) < 0 ||
		    fseek(f, 0, SEEK_SET) < 0 || (text = calloc(1, len + 1)) == NULL ||
		    fread(text, 1, len, f) != (size_t)len) {
			fprintf(stderr, "gpx-bench: GPX_TARGETS=%s cannot be read; no targets\n", path);
			if (f != NULL)
				fclose(f);
			return;
		}
		fclose(f);
	} else {
		path = "tests/results/TARGETS.md (built in)";
		if ((text = calloc(1, gpx_targets_text_len + 1)) == NULL)
			return;
		memcpy(text, gpx_targets_text, gpx_targets_text_len);
	}
	for (line = strtok_r(text, "\n", &save); line != NULL; line = strtok_r(NULL, "\n", &save))
		parse_line(line, path, ++lineno);
	free(text);
}

const struct bench_target *
bench_target(const char *id)
{
	if (!loaded)
		load();
	for (size_t i = 0; i < ntargets; i++)
		if (strcmp(targets[i].id, id) == 0)
			return &targets[i];
	return NULL;
}

/* "0.97x", "50 us", "500.0k copies/s": a target's value as its row prints it. */
static void
value_str(const struct bench_target *t, double v, char *buf, size_t len)
{
	if (strcmp(t->unit, "x") == 0)
		snprintf(buf, len, "%.3gx", v);
	else if (fabs(v) >= 1e4)
		snprintf(buf, len, "%.1fk %s", v / 1e3, t->unit);
	else
		snprintf(buf, len, "%.3g %s", v, t->unit);
}

int
bench_verdict(const char *id, double figure, char *buf, size_t len)
{
	const struct bench_target *t = bench_target(id);
	char want[48], got[48];

	if (t == NULL) {
		snprintf(buf, len, "no target %s in TARGETS.md", id);
		return -1;
	}
	value_str(t, t->value, want, sizeof(want));
	if (!isfinite(figure)) {
		snprintf(buf, len, "%s: not measured (%s %s)", id, t->less ? "<=" : ">=", want);
		return -1;
	}
	value_str(t, figure, got, sizeof(got));
	bool met = t->less ? figure <= t->value : figure >= t->value;
	snprintf(buf, len, "%s: %s (%s, target %s %s)", id, met ? "met" : "NOT MET", got,
	    t->less ? "<=" : ">=", want);
	return met;
}
