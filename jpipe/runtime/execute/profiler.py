"""Measured pipeline timelines: when each action ran on its device.

The driver dispatches actions asynchronously, so the host cannot see when
the device runs them. While profiling, one watcher thread per device waits
for each action's outputs in dispatch order and stamps when they are
ready: that is the action's end. Its start is the latest of its dispatch,
the end of the previous action on the same device (a device runs its
actions in order) and the end of the actions that produce its inputs. The
pipeline keeps running concurrently; the watchers only read. A program
that donates a buffer an action produced (a gradient accumulator) waits
until that action is stamped (``wait_for``), so profiling runs the same
compiled programs as any other step.
"""

import queue
import threading
import time

import jax

from jpipe.schedule import WEIGHT_GRADIENT, Timeline, ready_time


class ActionProfiler:
  """Collects device start/end times of a schedule's actions.

  Args:
    schedule: the action lists being run (``jpipe.schedule.ActionLists``:
      they give each stage's device).
  """

  def __init__(self, schedule):
    self.schedule = schedule
    self._t0 = time.perf_counter()
    self._dispatched: dict = {}
    self._ready_at: dict = {}
    self._arrived: dict = {}  # action -> when its remote inputs were ready
    self._stamped: dict = {}  # action -> threading.Event
    self._errors: list = []
    self._queues = [queue.Queue() for _ in range(schedule.num_devices)]
    self._threads = [
      threading.Thread(target=self._watch, args=(q,), daemon=True)
      for q in self._queues
    ]
    for t in self._threads:
      t.start()

  def _watch(self, q):
    while True:
      item = q.get()
      if item is None:
        return
      kind, action, arrays = item
      try:
        jax.block_until_ready(arrays)
      except Exception as e:  # noqa: BLE001 -- reported by timeline()
        self._errors.append(e)
      # Even if the program failed: nothing may wait forever.
      if kind == "inputs":
        self._arrived[action] = time.perf_counter() - self._t0
        continue
      self._ready_at[action] = time.perf_counter() - self._t0
      self._stamped[action].set()

  def record(self, action, outputs) -> None:
    """Called right after ``action`` is dispatched with its outputs."""
    self._dispatched[action] = time.perf_counter() - self._t0
    self._stamped[action] = threading.Event()
    device = self.schedule.stage_device[action.stage]
    self._queues[device].put(("outputs", action, outputs))

  def record_inputs(self, action, inputs) -> None:
    """Before ``record``: inputs of ``action`` that another process sends
    (their producers are not in this process's timeline). The action
    starts no earlier than they are ready."""
    device = self.schedule.stage_device[action.stage]
    self._queues[device].put(("inputs", action, inputs))

  def wait_for(self, action) -> None:
    """Returns once ``action``'s outputs are ready and stamped (before a
    program donates one of them)."""
    self._stamped[action].wait()

  def timeline(self) -> Timeline:
    """Waits for every recorded action; returns the measured timeline."""
    for q in self._queues:
      q.put(None)
    for t in self._threads:
      t.join()
    if self._errors:
      raise RuntimeError(
        f"profiling: an action's outputs could not be read: {self._errors[0]}"
      ) from self._errors[0]
    start, end, device_of = {}, {}, {}
    n = self.schedule.num_stages
    dev = self.schedule.stage_device
    pending_b = [[] for _ in range(n)]
    listed = frozenset(self._dispatched)
    clock = [0.0] * self.schedule.num_devices
    # Visit actions in dispatch order: producers before consumers.
    for action in sorted(self._dispatched, key=self._dispatched.get):
      d = dev[action.stage]
      deps = ready_time(action, end, dev, 0.0, pending_b, n, listed) or 0.0
      deps = max(deps, self._arrived.get(action, 0.0))
      start[action] = max(self._dispatched[action], clock[d], deps)
      end[action] = max(self._ready_at[action], start[action])
      clock[d] = end[action]
      device_of[action] = d
      if action.kind in WEIGHT_GRADIENT:
        pending_b[action.stage].append(action)
      elif action.kind == "S":
        pending_b[action.stage] = []
    origin = min(start.values())
    start = {a: t - origin for a, t in start.items()}
    end = {a: t - origin for a, t in end.items()}
    makespan = max(end.values())
    busy = [0.0] * self.schedule.num_devices
    for action, d in device_of.items():
      busy[d] += end[action] - start[action]
    bubble = 1.0 - sum(busy) / (len(busy) * makespan) if makespan else 0.0
    arrived = {a: t - origin for a, t in self._arrived.items()}
    return Timeline(
      start,
      end,
      device_of,
      makespan,
      tuple(busy),
      bubble,
      arrived=arrived,
      clock_origin=self._t0 + origin,
    )
