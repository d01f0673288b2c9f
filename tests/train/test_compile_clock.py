"""The compilation time a unit's throughput leaves out
(``jpipe.train.compile_clock``), against spans placed by hand."""

import threading
import time

import jax
import jax.numpy as jnp
import pytest

from jpipe.train.compile_clock import COMPILE_EVENTS, CompileClock


def test_spans_are_clipped_to_the_interval_and_overlaps_count_once():
  clock = CompileClock()
  clock._spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (9.0, 12.0)]
  # [1, 10]: [1, 3] (two overlapping spans, once) + [5, 6] + [9, 10].
  assert clock.within(1.0, 10.0) == pytest.approx(2.0 + 1.0 + 1.0)
  assert clock.within(6.5, 8.5) == 0.0
  # Spans that ended before an interval's start are forgotten.
  assert clock.within(7.0, 20.0) == pytest.approx(3.0)
  assert clock._spans == [(9.0, 12.0)]


def test_a_compile_inside_the_interval_is_measured_and_threads_once():
  with CompileClock() as clock:
    start = time.perf_counter()
    jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.ones(7)).block_until_ready()
    time.sleep(0.3)  # (The spans below start after ``start``.)
    # Two threads reporting the same 0.2 s at once: one 0.2 s of wall.
    threads = [
      threading.Thread(
        target=jax.monitoring.record_event_duration_secs,
        args=(COMPILE_EVENTS[2], 0.2),
      )
      for _ in range(2)
    ]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    end = time.perf_counter()
  covered = clock.within(start, end)
  assert 0.2 <= covered <= end - start
  jax.monitoring.record_event_duration_secs(COMPILE_EVENTS[2], 5.0)
  assert clock.within(start, end) == covered  # (Outside: not listening.)
