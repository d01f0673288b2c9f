"""Stop requests: agreed at once in one process; across processes at
intervals that keep the exchange near 1 % of the time and a request's
wait under a second."""

import math

import pytest

from jpipe.train import stopping


def test_one_process_knows_its_request_every_step():
  agree = stopping.StopAgreement()
  assert agree(1, None) is None
  assert agree(2, "SIGTERM", 0.01) == "SIGTERM"
  assert agree(3, "SIGINT", 0.01) == "SIGINT"
  # The exchange itself, in one process: this process's own request.
  assert stopping.agreed("SIGTERM") == "SIGTERM"
  assert stopping.agreed(None) is None


@pytest.mark.parametrize(
  "exchange_s,step_s",
  [(1e-3, 5e-3), (1e-3, 0.1), (1e-3, 1e-3), (1e-3, 2e-4), (5e-4, 2.0)],
)
def test_interval_keeps_the_exchange_near_one_percent(exchange_s, step_s):
  agree = stopping.StopAgreement(share=0.01, max_wait_s=1.0)
  agree.fastest = exchange_s
  k = agree._interval(step_s)
  # The restated rule: the fewest steps over which one exchange is <= 1 %
  # of the time, but no more steps than fit in one second (at least 1).
  want = max(1, min(math.ceil(exchange_s / (0.01 * step_s)), int(1.0 / step_s)))
  assert k == want
  assert k >= 1 and (k == 1 or (k - 1) * step_s < 1.0)
  assert exchange_s / (k * step_s) <= 0.01 or k * step_s >= 1.0 - step_s


def test_interval_is_one_before_anything_is_measured():
  agree = stopping.StopAgreement()
  assert agree._interval(None) == 1 and agree._interval(0.01) == 1


def test_watchdog_timeout_follows_steps_and_evaluations():
  """max(floor, 20x the median step, 3x the longest evaluation or
  checkpoint); a fixed timeout overrides."""
  from jpipe.train.watchdog import Watchdog

  dog = Watchdog(floor_s=300.0, factor=20.0)
  assert dog.timeout() == 300.0
  for seconds in (10.0, 30.0, 20.0):
    dog.beat("after a step", seconds)
  assert dog.timeout() == 20.0 * 20.0
  dog.beat("after an evaluation", other_seconds=200.0)
  assert dog.timeout() == 600.0
  assert Watchdog(42.0).timeout() == 42.0


def test_watchdog_names_frames_from_each_package_own_folder(tmp_path):
  """A frame in jpipe is named from jpipe's own folder; a file in some
  other folder named ``jpipe`` (a clone's, the checkout's root) keeps its
  whole path instead of being cut at the first ``/jpipe/``."""
  import types

  import jpipe.train.watchdog as watchdog

  def frame(filename):
    return types.SimpleNamespace(filename=filename, lineno=7, name="f")

  own = frame(watchdog.__file__)
  assert watchdog._frame_name(own) == "jpipe/train/watchdog.py:7 in f"
  outside = tmp_path / "jpipe" / "jpipe" / "train" / "loop.py"
  assert watchdog._frame_name(frame(str(outside))) == f"{outside}:7 in f"


def test_watchdog_says_where_a_thread_waits_in_jpipe(tmp_path):
  """``waiting_in``: a thread's innermost jpipe frames with the source
  line, then the innermost frame of all; a file in another folder named
  ``jpipe`` (a clone's tests) is not jpipe's."""
  import threading

  import jpipe.train.watchdog as watchdog
  from jpipe.parallel._hub import LocalHub

  outside = tmp_path / "jpipe" / "tests" / "waiter.py"
  outside.parent.mkdir(parents=True)
  outside.write_text("def wait_outside(event):\n  return event.wait()\n")
  namespace = {}
  exec(compile(outside.read_text(), str(outside), "exec"), namespace)
  release, entered = threading.Event(), threading.Event()

  def factory():  # Called by jpipe (LocalHub.share); waits outside it.
    entered.set()
    return namespace["wait_outside"](release)

  thread = threading.Thread(target=LocalHub().share, args=("x", factory))
  assert watchdog.waiting_in(thread) == "(not running)"
  thread.start()
  try:
    assert entered.wait(5)
    where = ""
    for _ in range(200):  # Until the thread is inside Event.wait.
      where = watchdog.waiting_in(thread)
      if "threading.py" in where:
        break
      release.wait(0.005)
    ours, _, inner = where.partition(", inside ")
    assert ours.startswith("jpipe/parallel/_hub.py:"), where
    assert "in share (return factory())" in ours, where
    assert str(outside) not in where and "threading.py" in inner, where
  finally:
    release.set()
    thread.join(5)
