"""The wall-clock time JAX spends compiling, so throughput leaves it out.

A run's first unit compiles every program, but not only it: a stream's
fused step programs, a flush's, an evaluation's are compiled when first
used, later; a resumed run compiles all again. An outside check read a
stream's first log window at 354-2,283 examples/s against ~15,000 after,
and each resume added compilation to ``time/train_seconds``. JAX reports
each compilation's phases (tracing, lowering, the backend's compile) as
durations (``jax.monitoring``); each ends when it is reported, so it spans
``[now - seconds, now]``. The clock keeps those spans and says how much of
a wall-clock interval they cover -- their union, so threads compiling at
once (SD-Pipe's pipelines) count once.
"""

import threading
import time

import jax

# jax.monitoring's events of one compilation's phases.
COMPILE_EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)


class CompileClock:
  """Compilation spans while inside (``with CompileClock() as clock``).

  ``clock.within(start, end)``: seconds of ``[start, end]``
  (``time.perf_counter`` readings) that compilation covered.
  """

  def __init__(self):
    self._spans: list[tuple[float, float]] = []
    self._lock = threading.Lock()

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._record)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._record)

  def _record(self, event: str, seconds: float, **kwargs) -> None:
    del kwargs
    if event in COMPILE_EVENTS:
      end = time.perf_counter()
      with self._lock:
        self._spans.append((end - seconds, end))

  def within(self, start: float, end: float) -> float:
    """Seconds of ``[start, end]`` some compilation covered; spans that
    ended before ``start`` are forgotten."""
    with self._lock:
      self._spans = [s for s in self._spans if s[1] > start]
      spans = sorted(
        (max(a, start), min(b, end)) for a, b in self._spans if a < end
      )
    covered, reach = 0.0, start
    for a, b in spans:
      a = max(a, reach)
      if b > a:
        covered += b - a
        reach = b
    return covered
