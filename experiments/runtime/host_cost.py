"""Where a pipeline step's host time goes per action, without a profiler.

The host's time until ``pipe.step`` returns (``timed_runner``'s
``host_seconds``) is split three ways per action, in microseconds:

- **driver**: jpipe's own Python -- lowering, the version policy, the
  stores of activations, cotangents and accumulators, the transfer ends.
  Measured by replaying: every stage program and optimizer update the
  driver calls returns, from then on, the outputs it returned the first
  time (recorded over one real step, copied), so a step runs the
  driver's Python and nothing of XLA but placing the microbatches, the
  moves between devices and the loss's mean.
- **dispatch**: what calling the step's programs costs around their
  run: for each program called, a jitted function of the same arguments
  that reads none of them (``keep_unused``) and returns as many arrays as
  the program did (scalars: what an output costs the host is its buffer
  and its Python array, not its size), timed alone, times how often the
  step calls it. This is JAX's argument and result handling and launch,
  the part that grows with the number of arrays a program takes (~0.2-1
  µs each on the 2-core machine of RESULTS.md) and returns (~4-6 µs
  each).
- **run**: the rest of the host's time: on a CPU the programs run
  inline on the dispatching thread (and the runtime's queue fills), so
  this is mostly execution; on a GPU, launching the kernels.

Replaying changes nothing a test or a user sees: it shadows the methods
on one pipeline's own objects and restores them on exit.
"""

import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np

# The stage-program getters of ``StagePrograms`` and the update and
# prediction entry points of ``StageOptimizer`` the driver calls.
PROGRAM_GETTERS = (
  "forward",
  "backward",
  "forward_backward",
  "input_grad",
  "weight_grad",
  "unpack",
  "with_step",
)
OPTIMIZER_CALLS = (
  "update",
  "update_packed",
  "update_packed_tied",
  "predict",
  "predict_packed",
)


def _copied(tree):
  """``tree`` with every array copied (its own buffers: a later program
  may donate the original)."""
  return jax.tree.map(
    lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree
  )


def _shapes(tree):
  """``tree`` with every array as its shape, dtype and sharding."""
  return jax.tree.map(
    lambda x: (
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      if isinstance(x, jax.Array)
      else x
    ),
    tree,
  )


class ProgramReplay:
  """Records, then replays, the programs one pipeline's driver calls.

  While ``recording``, each call runs for real and its first outputs
  (copied) and argument shapes are kept per program; once ``replaying``,
  every call returns the kept outputs and counts itself.
  """

  def __init__(self):
    self.outputs = {}  # program key -> first outputs (copied)
    self.arguments = {}  # program key -> (args, kwargs) as shapes
    self.calls = {}  # program key -> calls while replaying
    self.replaying = False

  def wrap(self, key, fn):
    """``fn`` as this replay runs it under ``key``."""

    def call(*args, **kwargs):
      if self.replaying:
        self.calls[key] = self.calls.get(key, 0) + 1
        return self.outputs[key]
      out = fn(*args, **kwargs)
      if key not in self.outputs:
        self.outputs[key] = _copied(out)
        self.arguments[key] = _shapes((args, kwargs))
      return out

    return call

  @contextlib.contextmanager
  def installed(self, pipe):
    """Shadows ``pipe``'s driver's program getters and optimizer calls
    with this replay's, restoring them on exit."""
    driver = pipe.driver
    programs, shadowed = driver.programs, []

    def getter(name):
      original, wrapped = getattr(programs, name), {}

      def get(*key):
        if key not in wrapped:  # One wrapper per program, as jpipe's.
          wrapped[key] = self.wrap((name, *key), original(*key))
        return wrapped[key]

      return get

    for name in PROGRAM_GETTERS:
      setattr(programs, name, getter(name))
      shadowed.append((programs, name, None))
    for s, opt in enumerate(driver.optimizers):
      for name in OPTIMIZER_CALLS:
        original = getattr(opt, name)
        if original is None:
          continue
        # A method (class attribute) is restored by deleting the shadow;
        # a jitted attribute of the instance by putting it back.
        own = vars(opt).get(name)
        setattr(opt, name, self.wrap((name, s), original))
        shadowed.append((opt, name, own))
    try:
      yield self
    finally:
      for obj, name, own in shadowed:
        if own is None:
          delattr(obj, name)
        else:
          setattr(obj, name, own)


def dispatch_seconds(arguments, repeats=200, outputs=1) -> float:
  """Seconds one call of a jitted function taking ``arguments`` (as
  ``_shapes``: ``(args, kwargs)``) and returning ``outputs`` arrays
  costs when it reads none of them: JAX's argument and result handling
  and launch, the program itself empty (its outputs zero scalars)."""
  args, kwargs = arguments
  live = jax.tree.map(
    lambda x: (
      jax.device_put(jnp.zeros(x.shape, x.dtype), x.sharding)
      if isinstance(x, jax.ShapeDtypeStruct)
      else x
    ),
    (args, {k: v for k, v in kwargs.items() if not isinstance(v, bool)}),
  )
  count = max(1, outputs)
  empty = jax.jit(
    lambda args, kwargs: [jnp.zeros(()) for _ in range(count)],
    keep_unused=True,
  )
  jax.block_until_ready(empty(*live))
  times = []
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(repeats // 5):
      out = empty(*live)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / (repeats // 5))
  return float(np.median(times))


def host_breakdown(pipe, run, actions, repeats=5) -> dict:
  """Per action, in microseconds, where the host's time of a step of
  ``pipe`` goes: ``host`` (until ``step`` returned: the median of the
  last ``repeats`` of ``run.host_seconds``, already timed by the caller),
  ``driver`` (its own Python: programs replayed), ``dispatch`` (calling
  them, empty), ``run`` (the rest). ``run``: ``timed_runner``'s, compiled
  and warm; ``actions``: the actions a step runs. The pipeline's state
  afterwards is the recorded step's (replayed steps return its values)."""
  host = float(np.median(run.host_seconds[-repeats:]))
  replay = ProgramReplay()
  with replay.installed(pipe):
    run()  # Recorded: every program's first outputs kept.
    replay.replaying = True
    replay.calls.clear()
    run()  # Replayed once: the calls a step makes, counted.
    per_step = dict(replay.calls)
    start = len(run.host_seconds)
    for _ in range(repeats):
      run()
    driver = float(np.median(run.host_seconds[start:]))
  dispatch = sum(
    n
    * dispatch_seconds(
      replay.arguments[key],
      outputs=len(jax.tree.leaves(replay.outputs[key])),
    )
    for key, n in per_step.items()
  )
  us = 1e6 / actions
  return {
    "host_us_per_action": host * us,
    "driver_us_per_action": driver * us,
    "dispatch_us_per_action": dispatch * us,
    "run_us_per_action": max(0.0, host - driver - dispatch) * us,
    "program_calls_per_step": sum(per_step.values()),
  }
