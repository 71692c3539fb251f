"""A pytest plugin that reports each test as one TAP line on the descriptor $GPX_TAP_FD, so that
automake's TAP driver (and the "N passed, N failed, N skipped" summary of ./dev check) counts
the Python tests one by one.  tests/python.test loads it with -p gpx_tap.

    ok N - file.py::test_name
    not ok N - file.py::test_name
    ok N - file.py::test_name # SKIP reason
"""
import os


def _name(nodeid):
    return nodeid.split("/")[-1]


class TapReporter:
    def __init__(self, out):
        self.out = out
        self.n = 0

    def emit(self, ok, name, directive=""):
        self.n += 1
        line = "%s %d - %s" % ("ok" if ok else "not ok", self.n, name.replace("#", "\\#"))
        if directive:
            line += " # " + directive.replace("\n", " ")
        self.out.write(line + "\n")
        self.out.flush()

    def pytest_runtest_logreport(self, report):
        name = _name(report.nodeid)
        if hasattr(report, "wasxfail"):
            if report.when == "call" or report.skipped:
                self.emit(report.passed, name, "TODO " + (report.wasxfail or "expected to fail"))
            return
        if report.skipped and report.when in ("setup", "call"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            if reason.startswith("Skipped: "):
                reason = reason[len("Skipped: "):]
            self.emit(True, name, "SKIP " + reason)
        elif report.when == "call" or (report.when == "setup" and report.failed):
            self.emit(report.passed, name)
        elif report.when == "teardown" and report.failed:
            self.emit(False, name + " (teardown)")

    def pytest_collectreport(self, report):
        if report.failed:
            self.emit(False, "collecting " + (_name(report.nodeid) or "tests"))
        elif report.skipped:
            # a whole file skipped (pytest.importorskip): one line for it
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            if reason.startswith("Skipped: "):
                reason = reason[len("Skipped: "):]
            self.emit(True, _name(report.nodeid), "SKIP " + reason)

    def pytest_sessionfinish(self, session, exitstatus):
        self.out.write("1..%d\n" % self.n)
        self.out.flush()


def pytest_configure(config):
    fd = os.environ.get("GPX_TAP_FD")
    if fd:
        config.pluginmanager.register(TapReporter(os.fdopen(int(fd), "w")), "gpx-tap-reporter")
