"""Re-partitioning for slowed devices: DynPipe's rule and jpipe's.

Both take per-node costs (seconds per microbatch, forward and backward),
the current split (stage boundaries over the nodes in program order) and
a slowdown factor per stage slot (its device computes that much slower).

- DynPipe (``dynpipe_split``, from its ``calculate_new_placement``): a
  node's weight is ``f + b + comm_in`` (+ ``comm_out`` inside the model);
  in each current stage the ``top_k`` heaviest nodes may end a stage
  (a cut right after them); every choice of S - 1 cuts among those is
  scored by DynPipe's own 1F1B simulation (99 microbatches, stage costs
  times their slowdown) and the best is kept (on a tie, the split in
  force).
- jpipe (``jpipe_split``): the exact min-max contiguous split with the
  slowed costs (``jpipe.partition.solve_contiguous``), every split, not
  only DynPipe's candidates.

``dynpipe_score`` is DynPipe's simulator; ``jpipe.schedule.simulate``
scores any schedule the runtime runs (``predicted_step_seconds``).
"""

import itertools
from collections.abc import Sequence

import numpy as np

from jpipe import schedule as schedule_lib
from jpipe.partition import GraphCosts, solve_contiguous


def stage_costs(node_seconds, boundaries, slowdown=None) -> np.ndarray:
  """Per stage, the sum of its nodes' seconds times its slowdown."""
  prefix = np.concatenate([[0.0], np.cumsum(node_seconds)])
  b = np.asarray(boundaries)
  out = prefix[b[1:]] - prefix[b[:-1]]
  return out if slowdown is None else out * np.asarray(slowdown, np.float64)


def candidate_cuts(weights, boundaries, top_k: int = 2) -> list[int]:
  """DynPipe's candidate cut positions: in each current stage (nodes
  ``boundaries[s]:boundaries[s+1]``), a cut right after each of its
  ``top_k`` heaviest nodes; sorted, without 0 and N (the fixed ends)."""
  w = np.asarray(weights, np.float64)
  n = w.shape[0]
  cuts = set()
  for a, b in zip(boundaries[:-1], boundaries[1:], strict=True):
    heaviest = a + np.argsort(-w[a:b], kind="stable")[:top_k]
    cuts.update(int(i) + 1 for i in heaviest)
  cuts.discard(n)
  cuts.discard(0)
  return sorted(cuts)


def node_weights(forward, backward, comm=None) -> np.ndarray:
  """DynPipe's per-node weight ``f + b + comm_in (+ comm_out inside)``;
  ``comm[i]``: seconds to send node i's output to the next node (None:
  0). The first node has no input transfer, the last no output."""
  f, b = np.asarray(forward, np.float64), np.asarray(backward, np.float64)
  c = np.zeros_like(f) if comm is None else np.asarray(comm, np.float64)
  comm_in = np.concatenate([[0.0], c[:-1]])
  comm_out = np.concatenate([c[:-1], [0.0]])
  return f + b + comm_in + comm_out


def dynpipe_score(forward, backward, comm=None, microbatches: int = 99):
  """DynPipe's 1F1B simulation: the steady-state time per microbatch.

  Stage s (of S) runs ``S - s - 1`` warm-up forwards, then alternates;
  ``F[s][m]`` starts after the stage's previous forward, the previous
  stage's ``F[s-1][m]`` plus its transfer, and the stage's backward of
  microbatch ``m - (S - s)``; the last stage's backward follows its
  forward; ``B[s][m]`` starts after the stage's previous operation and
  ``B[s+1][m]`` plus its transfer. The score is the mean over k of
  ``(start F[0][kS] - start F[0][(k-1)S]) / S``.

  Args:
    forward, backward: per stage, seconds per microbatch.
    comm: per stage boundary s -> s+1, seconds (default 0), [S - 1].
  """
  f, b = np.asarray(forward, np.float64), np.asarray(backward, np.float64)
  n = f.shape[0]
  c = np.zeros(max(n - 1, 0)) if comm is None else np.asarray(comm, float)
  m = microbatches
  start = _simulate_starts(_one_f_one_b_orders(n, m), f, b, c)
  gaps = [
    (start[(0, "F", k * n)] - start[(0, "F", (k - 1) * n)]) / n
    for k in range(1, (m - 1) // n + 1)
  ]
  if not gaps:
    raise ValueError(f"{m} microbatches are too few for {n} stages")
  return float(np.mean(gaps))


def _one_f_one_b_orders(n: int, m: int) -> list[list[tuple[str, int]]]:
  """Per stage of ``n``, its 1F1B order of ``m`` microbatches:
  ``S - s - 1`` warm-up forwards, then F and B alternating, then the
  remaining backwards."""
  orders = []
  for s in range(n):
    warm = min(n - s - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
      order += [("F", warm + i), ("B", i)]
    order += [("B", i) for i in range(m - warm, m)]
    orders.append(order)
  return orders


def _simulate_starts(orders, f, b, c) -> dict[tuple[int, str, int], float]:
  """``{(stage, kind, microbatch): start time}`` of every operation of
  ``orders``, each starting once its dependencies ended (see
  ``dynpipe_score``)."""
  n = len(orders)
  start, end = {}, {}
  done = [0] * n
  while any(done[s] < len(orders[s]) for s in range(n)):
    progressed = False
    for s in range(n):
      while done[s] < len(orders[s]):
        kind, i = orders[s][done[s]]
        deps = []
        if done[s] > 0:
          deps.append(("end", s, *orders[s][done[s] - 1]))
        if kind == "F" and s > 0:
          deps.append(("comm", s - 1, "F", i))
        if kind == "B" and s < n - 1:
          deps.append(("comm", s + 1, "B", i))
        if kind == "B" and s == n - 1:
          deps.append(("end", s, "F", i))
        times = []
        for what, t, k, j in deps:
          if (t, k, j) not in end:
            break
          hop = c[min(s, t)] if what == "comm" else 0.0
          times.append(end[(t, k, j)] + hop)
        else:
          begin = max(times, default=0.0)
          start[(s, kind, i)] = begin
          end[(s, kind, i)] = begin + (f[s] if kind == "F" else b[s])
          done[s] += 1
          progressed = True
          continue
        break
    if not progressed:
      raise RuntimeError("the 1F1B simulation is stuck (a bug)")
  return start


def dynpipe_split(
  forward,
  backward,
  boundaries,
  slowdown,
  *,
  comm=None,
  top_k: int = 2,
  microbatches: int = 99,
) -> tuple[tuple[int, ...], float]:
  """DynPipe's re-partition: ``(new boundaries, their score)``.

  Args:
    forward, backward: per node, seconds per microbatch.
    boundaries: the current split (0, b1, ..., N).
    slowdown: per stage slot, its device's factor; or a function of a
      candidate split giving its stages' factors (DynPipe's predictor).
    comm: per node, seconds to send its output on (default 0).
  """
  n_nodes = len(forward)
  stages = len(boundaries) - 1
  weights = node_weights(forward, backward, comm)
  cuts = candidate_cuts(weights, boundaries, top_k)
  c = np.zeros(n_nodes) if comm is None else np.asarray(comm, np.float64)
  best, best_score = tuple(boundaries), np.inf
  current_score = None
  for chosen in itertools.combinations(cuts, stages - 1):
    split = (0, *chosen, n_nodes)
    factors = slowdown(split) if callable(slowdown) else slowdown
    score = dynpipe_score(
      stage_costs(forward, split, factors),
      stage_costs(backward, split, factors),
      [c[i - 1] for i in chosen],
      microbatches,
    )
    if split == tuple(boundaries):
      current_score = score
    if score < best_score:
      best, best_score = split, score
  # A tie with the split in force keeps it (DynPipe's argmin takes the
  # first in its enumeration and would move for nothing).
  if current_score is not None and current_score <= best_score:
    best = tuple(boundaries)
  return best, float(best_score)


def jpipe_split(forward, backward, slowdown, memory=None):
  """The exact min-max contiguous split with slowed stage slots:
  ``(boundaries, bottleneck seconds)``; ``memory``: a
  ``jpipe.partition.MemoryModel`` the split keeps to."""
  compute = np.asarray(forward, np.float64) + np.asarray(backward, np.float64)
  solution = solve_contiguous(
    GraphCosts(compute), len(slowdown), memory=memory, stage_slowdown=slowdown
  )
  return solution.boundaries, solution.bottleneck_seconds


def minmax_split(stage_seconds) -> tuple[tuple[int, ...], float]:
  """The exact min-max contiguous split when a stage's time depends on
  its slot and its whole node range (a predicted slowdown per range):
  ``(boundaries, bottleneck seconds)``.

  Args:
    stage_seconds: [S, N + 1, N + 1]; ``[s, lo, hi]`` is nodes ``lo:hi``
      as stage s (only lo < hi is read).
  """
  t = np.asarray(stage_seconds, np.float64)
  stages, n = t.shape[0], t.shape[1] - 1
  if not 1 <= stages <= n:
    raise ValueError(f"cannot split {n} nodes into {stages} stages")
  # best[s, hi]: the least bottleneck of nodes 0:hi in stages 0..s.
  best = np.full((stages, n + 1), np.inf)
  cut = np.zeros((stages, n + 1), np.int64)
  best[0, 1:] = t[0, 0, 1:]
  for s in range(1, stages):
    for hi in range(s + 1, n + 1):
      lo = np.arange(s, hi)
      worst = np.maximum(best[s - 1, lo], t[s, lo, hi])
      i = int(np.argmin(worst))
      best[s, hi], cut[s, hi] = worst[i], lo[i]
  boundaries = [n]
  for s in range(stages - 1, 0, -1):
    boundaries.append(int(cut[s, boundaries[-1]]))
  return (0, *reversed(boundaries)), float(best[stages - 1, n])


def predicted_step_seconds(
  forward,
  backward,
  boundaries,
  slowdown,
  *,
  schedule: str = "1f1b",
  microbatches: int = 8,
  comm_seconds: float = 0.0,
) -> float:
  """jpipe's event simulator on ``schedule`` with the split's slowed
  stage costs: seconds per step of ``microbatches``."""
  stages = len(boundaries) - 1
  lists = schedule_lib.build(schedule, stages, microbatches)
  timeline = schedule_lib.simulate(
    lists,
    list(stage_costs(forward, boundaries, slowdown)),
    list(stage_costs(backward, boundaries, slowdown)),
    comm_seconds=comm_seconds,
  )
  return float(timeline.makespan)


def boundaries_of(stage_of_node: Sequence[int]) -> tuple[int, ...]:
  """A straight plan's stage boundaries from its node -> stage map."""
  of = np.asarray(stage_of_node)
  if np.any(np.diff(of) < 0):
    raise ValueError("a re-partition needs a straight plan (stages in order)")
  stages = int(of.max()) + 1
  return (0, *[int(np.searchsorted(of, s)) for s in range(1, stages)], len(of))


def stage_of_node(boundaries: Sequence[int]) -> tuple[int, ...]:
  """The node -> stage map of a split."""
  b = np.asarray(boundaries)
  return tuple(int(s) for s in np.repeat(np.arange(len(b) - 1), np.diff(b)))
