"""Test set-up: 8 fake CPU devices and quick compiles, set before jax is
imported, and one persistent XLA compilation cache for the whole run."""

import collections
import os
import shutil
import tempfile

from tests.quick_compiles import NO_OPTIMIZATIONS, with_quick_compiles

# Quick compiles (tests/quick_compiles.py); the processes tests start
# inherit them.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["XLA_FLAGS"] = with_quick_compiles(os.environ["XLA_FLAGS"])
os.environ.setdefault(NO_OPTIMIZATIONS, "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# --cpu-times=N: the tests with the most CPU seconds (tests/cpu_times.py).
pytest_plugins = ["tests.cpu_times"]

# Many tests build pipelines whose stage programs are the same HLO as
# another test's (same model, same split), and every new Pipeline jits
# new closures. A persistent cache serves those from disk instead of
# recompiling (the suite is compile-bound on 2 cores). The first process
# (pytest, or xdist's controller, before it spawns workers) makes the
# folder; the workers inherit it and the controller removes it at the end.
# Set JPIPE_TEST_XLA_CACHE to a folder of your own to keep it across runs.
_OWN_CACHE = "JPIPE_TEST_XLA_CACHE" not in os.environ
if _OWN_CACHE:
  os.environ["JPIPE_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jpipe-xla-")
jax.config.update(
  "jax_compilation_cache_dir", os.environ["JPIPE_TEST_XLA_CACHE"]
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# The processes tests start (the CLI, launched workers) share it: a
# reference run and its resumption, or every process of a run, compile
# the same programs once.
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JPIPE_TEST_XLA_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_xdist_auto_num_workers(config):
  """``-n auto``: one worker more than the cores this process may use.

  With a worker per core the cores idle while tests wait on the processes
  they start (launches, imports, gloo barriers, watchdogs, simulated slow
  devices): on 2 cores the slow tier took 23:40 with 2 workers and 20:06
  with 3, paired on one machine (BUILD.md, "Tests")."""
  if config.option.numprocesses != "auto":
    return None  # ("logical": xdist's own count.)
  return len(os.sched_getaffinity(0)) + 1


def pytest_unconfigure(config):
  """Removes the run's compilation cache (in the process that made it)."""
  if _OWN_CACHE and not hasattr(config, "workerinput"):
    shutil.rmtree(os.environ["JPIPE_TEST_XLA_CACHE"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
  """Skips GPU tests when no GPU is present."""
  if any(d.platform == "gpu" for d in jax.devices()):
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _compute_bound_compiles(request, monkeypatch):
  """A test marked ``compute_bound`` runs with XLA's optimisations on,
  in process and in the processes it starts (tests/quick_compiles.py:
  tens of steps of convolutions spend more running unoptimised programs
  than optimising them costs)."""
  if request.node.get_closest_marker("compute_bound") is None:
    yield
    return
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  monkeypatch.setenv(NO_OPTIMIZATIONS, "0")
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", previous)


@pytest.fixture(scope="module")
def xla_optimizations():
  """For modules about what XLA's optimisations do to a program: turns
  them back on (the suite runs without most, tests/quick_compiles.py;
  use with ``pytestmark``)."""
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)


# Where the suite's time goes: XLA compilations per test (the suite is
# compile-bound on 2 cores). `--compile-times=N` lists the N tests that
# spent the most seconds in XLA's backend compiler, with their compile
# and persistent-cache-hit counts (BUILD.md, "Tests").
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_compiled = {"seconds": 0.0, "compiles": 0, "cache_hits": 0}
# Compile seconds per program name (``jit(add)``: an operation run
# eagerly, outside any jitted function, compiles a program of its own).
_by_program = collections.Counter()


def _on_duration(event, duration, fun_name="?", **_):
  if event == _COMPILE_EVENT:
    _compiled["seconds"] += duration
    _compiled["compiles"] += 1
    _by_program[fun_name] += duration


def _on_event(event, **_):
  if event == _CACHE_HIT_EVENT:
    _compiled["cache_hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def pytest_addoption(parser):
  parser.addoption(
    "--compile-times",
    type=int,
    default=0,
    metavar="N",
    help="list the N tests with the most XLA compile seconds",
  )


_COMPILED_KEY = pytest.StashKey[dict]()
_compile_rows = []  # (seconds, counts, test id) as reports arrive.


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Counts the test's compilations, setup and teardown included (only
  when they are to be listed)."""
  if item.config.getoption("--compile-times"):
    item.stash[_COMPILED_KEY] = (
      dict(_compiled),
      collections.Counter(_by_program),
    )
  yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if call.when == "teardown" and _COMPILED_KEY in item.stash:
    before, before_programs = item.stash[_COMPILED_KEY]
    spent = {k: _compiled[k] - before[k] for k in _compiled}
    spent["programs"] = dict(_by_program - before_programs)
    report.user_properties.append(("xla_compile", spent))


def pytest_runtest_logreport(report):
  """(Under xdist, in the controller: the workers' reports.)"""
  for name, spent in report.user_properties:
    if name == "xla_compile":
      _compile_rows.append((spent["seconds"], spent, report.nodeid))


def pytest_terminal_summary(terminalreporter, config):
  count = config.getoption("--compile-times")
  if not count:
    return
  rows = sorted(_compile_rows, key=lambda r: -r[0])
  total = sum(r[0] for r in rows)
  terminalreporter.section(
    f"XLA compile time: {total:.0f} s in all, the {count} most"
  )
  for seconds, spent, nodeid in rows[:count]:
    terminalreporter.write_line(
      f"{seconds:8.2f}s {spent['compiles']:5d} compiles "
      f"{spent['cache_hits']:5d} cache hits  {nodeid}"
    )
  programs = sum(
    (collections.Counter(r[1]["programs"]) for r in rows), collections.Counter()
  )
  terminalreporter.section(f"XLA compile time by program, the {count} most")
  for name, seconds in programs.most_common(count):
    terminalreporter.write_line(f"{seconds:8.2f}s  {name}")
