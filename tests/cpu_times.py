"""``--cpu-times=N``: the N tests that used the most CPU seconds, their
own process's (every thread: XLA's compiles and kernels) plus the
processes they started and waited for (a launched run, the CLI).

Under ``-n auto`` the suite keeps more workers than cores busy, so a
test's wall-clock seconds (``--durations``) hold its neighbours' work
too; its CPU seconds are its own, which is what the suite's time on 2
saturated cores is the sum of (BUILD.md, "Tests"). Registered by
``tests/conftest.py``.
"""

import collections
import resource

import pytest

_KEY = pytest.StashKey[tuple]()
_rows = []  # (own + children, own, children, test id) as reports arrive.


def pytest_addoption(parser):
  parser.addoption(
    "--cpu-times",
    type=int,
    default=0,
    metavar="N",
    help="list the N tests with the most CPU seconds (with their children)",
  )


def _cpu_seconds() -> tuple[float, float]:
  """(this process's user + system seconds, its waited-for children's)."""
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return (
    own.ru_utime + own.ru_stime,
    children.ru_utime + children.ru_stime,
  )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Notes the CPU clocks before the test (setup and teardown count)."""
  if item.config.getoption("--cpu-times"):
    item.stash[_KEY] = _cpu_seconds()
  yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if call.when == "teardown" and _KEY in item.stash:
    own, children = _cpu_seconds()
    before_own, before_children = item.stash[_KEY]
    report.user_properties.append(
      ("cpu_seconds", (own - before_own, children - before_children))
    )


def pytest_runtest_logreport(report):
  """(Under xdist, in the controller: the workers' reports.)"""
  for name, value in report.user_properties:
    if name == "cpu_seconds":
      own, children = value
      _rows.append((own + children, own, children, report.nodeid))


def pytest_terminal_summary(terminalreporter, config):
  count = config.getoption("--cpu-times")
  if not count:
    return
  rows = sorted(_rows, key=lambda r: -r[0])
  total = sum(r[0] for r in rows)
  terminalreporter.section(
    f"CPU seconds: {total:.0f} in all (tests and their processes), "
    f"the {count} most"
  )
  terminalreporter.write_line("   total     own  children  test")
  for seconds, own, children, nodeid in rows[:count]:
    terminalreporter.write_line(
      f"{seconds:8.1f}{own:8.1f}{children:10.1f}  {nodeid}"
    )
  by_file = collections.Counter()
  for seconds, _, _, nodeid in rows:
    by_file[nodeid.split("::")[0]] += seconds
  terminalreporter.section(f"CPU seconds by file, the {count} most")
  for path, seconds in by_file.most_common(count):
    terminalreporter.write_line(f"{seconds:8.1f}  {path}")
