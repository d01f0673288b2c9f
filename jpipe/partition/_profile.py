"""Per-node costs of a traced model: XLA's cost analysis or measured times.

Each node is compiled on its own (the finest stage split: one node per
stage), with the real activations that reach it, so both methods see the
shapes the model runs with.
"""

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from jpipe.partition._stages import Stages
from jpipe.partition._trace import TracedModel


@dataclasses.dataclass(frozen=True)
class NodeCosts:
  """Forward and backward cost of every node.

  Attributes:
    forward_seconds, backward_seconds: float64 [num_nodes]. For "xla" these
      are FLOPs / ``flops_per_second``; for "measured", median wall times.
    forward_flops, backward_flops: XLA's FLOP counts, float64 [num_nodes].
    method: "xla", "measured" or "analytic".
  """

  forward_seconds: np.ndarray
  backward_seconds: np.ndarray
  forward_flops: np.ndarray
  backward_flops: np.ndarray
  method: str


def profile_nodes(
  traced: TracedModel,
  params: Any,
  batch: Any,
  *,
  method: str = "xla",
  flops_per_second: float = 1e12,
  repeats: int = 5,
  recompute: bool = True,
) -> NodeCosts:
  """Costs of each node's forward and backward.

  Args:
    traced: the traced model.
    params, batch: the inputs (activations are computed from them), or
      params as ``jax.ShapeDtypeStruct``s ("xla", "analytic": the nodes'
      outputs by ``jax.eval_shape``, nothing runs).
    method: "xla" (cost analysis of the compiled node; no timing),
      "measured" (compiled node run ``repeats`` times on the default
      device; the median, after one warm-up run) or "analytic" (FLOPs
      counted from the jaxpr, backward = 2x forward (+1x recomputed); no
      compilation, for large models).
    flops_per_second: converts FLOPs to seconds for "xla".
    repeats: timed runs per node for "measured".
    recompute: backward recomputes the forward (its cost includes it, as
      FTPipe profiles recomputation) or uses saved residuals.

  Returns:
    NodeCosts.
  """
  if method not in ("xla", "measured", "analytic"):
    raise ValueError(
      f"unknown method {method!r}: use 'xla', 'measured' or 'analytic'"
    )
  if flops_per_second <= 0 or repeats < 1:
    raise ValueError("flops_per_second must be > 0 and repeats >= 1")
  if method == "analytic":  # No compilation: count from the jaxpr.
    fwd = traced.node_flops()
    bwd = (3.0 if recompute else 2.0) * fwd
    return NodeCosts(
      fwd / flops_per_second, bwd / flops_per_second, fwd, bwd, method
    )
  # Params as shapes only (a model too big to hold): each node's outputs
  # by jax.eval_shape, its FLOPs from its compilation; nothing runs.
  abstract = any(
    isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)
  )
  if abstract and method == "measured":
    raise ValueError(
      "method='measured' runs each node: give real params, or use 'xla' "
      "or 'analytic' on shapes"
    )
  run = (
    (lambda f, *a: jax.eval_shape(f, *a)) if abstract else (lambda f, *a: f(*a))
  )
  nodes = Stages(traced, list(range(traced.num_nodes)))
  stage_params = nodes.split_params(params)
  stage_batch = nodes.split_batch(batch)
  values: dict[Any, Any] = {}
  n = traced.num_nodes
  fwd_flops, bwd_flops = np.zeros(n), np.zeros(n)
  fwd_time, bwd_time = np.zeros(n), np.zeros(n)
  for s, spec in enumerate(nodes.specs):
    acts = tuple(values[v] for v in spec.inputs)
    args = (stage_params[s], stage_batch[s], acts)
    fwd = jax.jit(lambda *a, s=s: nodes.forward(s, *a))
    outputs, results = run(fwd, *args)
    values.update(zip(spec.outputs, outputs, strict=True))
    out_cots = tuple(
      np.ones(o.shape, o.dtype) if _float(o) else None for o in outputs
    )
    res_cots = tuple(1.0 if r == 0 else None for r in spec.results)
    bwd = jax.jit(lambda *a, s=s: nodes.backward(s, *a))
    bwd_args = (*args, out_cots, res_cots)
    if not recompute:
      saving = jax.jit(lambda *a, s=s: nodes.forward_saving(s, *a))
      _, _, residuals = run(saving, *args)
      bwd = jax.jit(
        lambda p, r, o, c, s=s: nodes.backward_from_residuals(s, p, r, o, c)
      )
      bwd_args = (args[0], residuals, out_cots, res_cots)
    fwd_flops[s] = _flops(fwd, args)
    bwd_flops[s] = _flops(bwd, bwd_args)
    if method == "measured":
      fwd_time[s] = _median_time(fwd, args, repeats)
      bwd_time[s] = _median_time(bwd, bwd_args, repeats)
  if method == "xla":
    fwd_time = fwd_flops / flops_per_second
    bwd_time = bwd_flops / flops_per_second
  return NodeCosts(fwd_time, bwd_time, fwd_flops, bwd_flops, method)


def _float(x) -> bool:
  return bool(np.issubdtype(np.dtype(x.dtype), np.inexact))


def _flops(jitted, args) -> float:
  analysis = jitted.lower(*args).compile().cost_analysis()
  if isinstance(analysis, list):  # Older jax returns one dict per device.
    analysis = analysis[0] if analysis else {}
  return float((analysis or {}).get("flops", 0.0))


def _median_time(jitted, args, repeats) -> float:
  jax.block_until_ready(jitted(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))
