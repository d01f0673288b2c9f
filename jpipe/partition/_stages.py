"""Build per-stage forward and backward functions from a traced model.

Given a stage for every node, each stage becomes a function of its inputs
— the parameter leaves it reads, the batch leaves it reads, and the values
earlier stages produced that it consumes — evaluating its equations of the
traced jaxpr. A value consumed by several later stages (a long skip, an
encoder output feeding every decoder stage) is sent to each of them, and
its cotangents are summed. A parameter read by several stages (a tied
embedding) is an input of each: the stages are replicas of it and its
gradient is the sum of their gradients (``Stages.gather_grads``); keeping
the replicas equal is the runtime's job.

Backward comes in two modes: ``backward`` recomputes the forward under
``jax.vjp`` (only the stage inputs are kept), and ``forward_saving`` +
``backward_from_residuals`` keep XLA's residuals from the forward (the vjp
closure is a pytree, so it crosses ``jit``). A stage with no outputs (the
last) can also run both at once, ``forward_backward``.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from jpipe.partition._backward_split import BackwardSplit, split_backward
from jpipe.partition._eval import eval_eqn, read
from jpipe.partition._scan_layers import eval_run, fuse_runs
from jpipe.partition._stage_layout import StageLayout
from jpipe.partition._state_updates import place_state_updates
from jpipe.partition._trace import TracedModel


@dataclasses.dataclass(frozen=True, eq=False)
class StageSpec:
  """What one stage reads and writes.

  Attributes:
    eqns: indices of its equations in the traced jaxpr, in program order.
    param_leaves: indices of the parameter leaves it reads (the last
      stage of a pipeline's training program: also those no stage reads,
      ``hold_unread_params``).
    batch_leaves: indices (among batch leaves) of the batch leaves it reads.
    inputs: values from earlier stages it consumes (jaxpr vars).
    outputs: values it produces that later stages consume (jaxpr vars).
    results: indices of the loss function's flat outputs it produces.
  """

  eqns: tuple[int, ...]
  param_leaves: tuple[int, ...]
  batch_leaves: tuple[int, ...]
  inputs: tuple[Any, ...]
  outputs: tuple[Any, ...]
  results: tuple[int, ...]


class Stages(StageLayout):
  """Stage functions of a traced model under a node -> stage assignment.

  Per stage s (all pure, jit them as you like; ``jitted(s)`` caches them):
    ``forward(s, params, batch, acts) -> (outputs, results)``
    ``backward(s, params, batch, acts, out_cots, result_cots)
        -> (param_grads, act_cots)``          (recomputes the forward)
    ``forward_saving(s, ...) -> (outputs, results, residuals)``
    ``backward_from_residuals(s, params, residuals, out_cots, result_cots)``
  ``params`` / ``batch`` are the stage's own leaves (tuples, in
  ``spec.param_leaves`` / ``spec.batch_leaves`` order), ``acts`` the values
  in ``spec.inputs`` order. ``run_forward`` / ``run_backward`` chain all
  stages in order on one device (the reference schedule).

  ``residual_policy`` is the ``jax.checkpoint`` policy of
  ``forward_saving``: which intermediates are saved for the backward.
  The default, ``dots_saveable``, saves matrix-multiply outputs and lets the
  backward recompute the elementwise ops between them inside its own
  program. Saving every intermediate (``everything_saveable``) writes each
  to memory between two programs that XLA can no longer fuse across; on
  a CPU that made a GPT's saved-residual pipeline 1.2-1.4x slower than
  one fused value_and_grad (experiments/runtime/overhead.py).

  ``num_stages``: the stage count where some stage may have no nodes (a
  function cut by another's plan, ``follow_plan``); None: every stage
  from 0 to the largest in ``stage_of_node`` has some.

  ``carried`` names model state: ``(batch leaf, result)`` pairs whose
  result is the batch leaf's value for the next microbatch. The equations
  that only compute such a new value run on the stage that reads the old
  one, so microbatches update it in order (``_state_updates``);
  ``eqn_stage`` is every equation's stage after that move.

  ``compiler_options``: XLA options every ``jitted`` program is compiled
  with (``jax.jit``'s), e.g. the runtime's GPU options.

  ``residual_own_bytes``: ``forward_saving``'s residuals of at least this
  many bytes are returned as their own arrays, smaller ones packed; None:
  the default device's platform's (``default_residual_own_bytes``).

  ``hold_unread_params``: the last stage also holds the param leaves no
  equation reads (a training program: every param is stepped, saved and
  gathered; a function cut by another's plan reads only what it reads).
  """

  def __init__(
    self,
    traced: TracedModel,
    stage_of_node: Sequence[int],
    residual_policy: Callable | None = jax.checkpoint_policies.dots_saveable,
    carried: Sequence[tuple[int, int]] = (),
    num_stages: int | None = None,
    compiler_options: dict[str, Any] | None = None,
    residual_own_bytes: float | None = None,
    hold_unread_params: bool = False,
  ):
    if len(stage_of_node) != traced.num_nodes:
      raise ValueError(
        f"stage_of_node has {len(stage_of_node)} entries for "
        f"{traced.num_nodes} nodes"
      )
    stage_of_node = [int(s) for s in stage_of_node]
    if min(stage_of_node) < 0:
      raise ValueError("stage indices must be >= 0")
    if num_stages is None:  # Every stage has nodes.
      self.num_stages = max(stage_of_node) + 1
      missing = set(range(self.num_stages)) - set(stage_of_node)
      if missing:
        raise ValueError(f"stages {sorted(missing)} have no nodes")
    elif max(stage_of_node) >= num_stages:
      raise ValueError(f"stage indices must be < num_stages={num_stages}")
    else:  # A function cut by another's plan: a stage may run nothing.
      self.num_stages = num_stages
    self.traced = traced
    self.stage_of_node = tuple(stage_of_node)
    self.eqn_stage = tuple(
      place_state_updates(
        traced.jaxpr,
        [self.stage_of_node[n] for n in traced.eqn_node],
        traced.num_param_leaves,
        carried,
        traced.leaf_paths,
      )
    )
    self.specs = _specs(
      traced,
      self.eqn_stage,
      self.num_stages,
      traced.unread_param_leaves() if hold_unread_params else (),
      carried,
    )
    # A stage's iterations of a scan over layers run as one scan.
    self._items = [
      fuse_runs(spec.eqns, traced.eqn_iteration, traced.eqn_slices)
      if traced.eqn_iteration
      else list(spec.eqns)
      for spec in self.specs
    ]
    # Which stage inputs get cotangents (floating point values only).
    self._diff = [
      tuple(_inexact(v.aval.dtype) for v in spec.inputs) for spec in self.specs
    ]
    self._jitted: dict[tuple[str, int], Any] = {}
    self._pullback_layout: dict[int, Any] = {}
    self._weight_split: dict[int, BackwardSplit] = {}
    self.residual_policy = residual_policy
    if residual_own_bytes is None:
      residual_own_bytes = default_residual_own_bytes(jax.devices()[0].platform)
    self.residual_own_bytes = residual_own_bytes
    self.compiler_options = dict(compiler_options or {})

  def differentiable_inputs(self, s: int) -> tuple[bool, ...]:
    """Per input of stage s, whether its backward returns a cotangent for
    it (inexact dtypes; None for the others)."""
    return self._diff[s]

  # -- pure stage functions ------------------------------------------------

  def forward(self, s: int, params, batch, acts):
    """Stage s: ``(outputs, results)`` as tuples."""
    spec = self.specs[s]
    jaxpr = self.traced.jaxpr
    env = {}
    for v, x in zip(
      jaxpr.constvars, self.traced.closed_jaxpr.consts, strict=True
    ):
      env[v] = x
    n_params = self.traced.num_param_leaves
    for i, x in zip(spec.param_leaves, params, strict=True):
      env[jaxpr.invars[i]] = x
    for i, x in zip(spec.batch_leaves, batch, strict=True):
      env[jaxpr.invars[n_params + i]] = x
    for v, x in zip(spec.inputs, acts, strict=True):
      env[v] = x
    for item in self._items[s]:
      if isinstance(item, tuple):
        eval_run([jaxpr.eqns[i] for i in item], env)
      else:
        eval_eqn(jaxpr.eqns[item], env)
    outputs = tuple(env[v] for v in spec.outputs)
    results = tuple(read(env, jaxpr.outvars[r]) for r in spec.results)
    return outputs, results

  def _vjp(self, s, params, batch, acts, policy=None):
    diff = self._diff[s]

    def fn(params, diff_acts):
      it = iter(diff_acts)
      full = tuple(
        next(it) if d else a for a, d in zip(acts, diff, strict=True)
      )
      return self.forward(s, params, batch, full)

    diff_acts = tuple(a for a, d in zip(acts, diff, strict=True) if d)
    if policy is not None:
      fn = jax.checkpoint(fn, policy=policy)
    (outputs, results), vjp_fn = jax.vjp(fn, tuple(params), diff_acts)
    return outputs, results, vjp_fn

  def _pull(self, s, vjp_fn, out_cots, result_cots):
    diff = self._diff[s]
    spec = self.specs[s]
    out_cots = tuple(
      _cotangent(v, c) for v, c in zip(spec.outputs, out_cots, strict=True)
    )
    result_cots = tuple(
      _cotangent(self.traced.jaxpr.outvars[r], c)
      for r, c in zip(spec.results, result_cots, strict=True)
    )
    param_grads, diff_cots = vjp_fn((out_cots, result_cots))
    it = iter(diff_cots)
    act_cots = tuple(next(it) if d else None for d in diff)
    return param_grads, act_cots

  def forward_saving(self, s: int, params, batch, acts):
    """Forward that keeps residuals for :meth:`backward_from_residuals`.

    The residuals are returned as a tuple of arrays; the structure of the
    pullback (which holds the linearized computation, the same for every
    call with these shapes) is kept on the side, so jitted callers see a
    fixed pytree and never re-trace. Residuals that are the stage's params
    are not returned (the backward takes the params again), and those
    below ``residual_own_bytes`` are packed into one flat buffer per
    dtype: every output buffer costs the host a few microseconds per
    call, and a pullback holds dozens, but packing copies them (and the
    backward copies a slice that feeds a matmul), which costs more than
    that from a few KiB on a CPU.
    """
    outputs, results, vjp_fn = self._vjp(
      s, params, batch, acts, self.residual_policy
    )
    leaves, treedef = jax.tree.flatten(vjp_fn)
    layout, residuals = _pack_residuals(leaves, params, self.residual_own_bytes)
    self._pullback_layout[s] = (treedef, layout)
    return outputs, results, residuals

  def intermediates(self, s: int, params, batch, acts) -> tuple:
    """Every intermediate a recomputing backward of stage s holds for its
    pullback (its params excluded): the arrays ``backward`` rebuilds
    before XLA fuses or frees any, an upper bound on its working set."""
    _, _, vjp_fn = self._vjp(s, params, batch, acts)
    param_ids = {id(p) for p in params}
    return tuple(
      leaf for leaf in jax.tree.leaves(vjp_fn) if id(leaf) not in param_ids
    )

  def backward_from_residuals(
    self, s: int, params, residuals, out_cots, result_cots
  ):
    """``(param_grads, act_cots)`` from saved residuals (no recompute).

    ``params`` must be the params the forward ran with.
    """
    if s not in self._pullback_layout:
      raise ValueError(f"stage {s}: call forward_saving before backward")
    treedef, layout = self._pullback_layout[s]
    leaves = _unpack_residuals(layout, params, residuals)
    vjp_fn = jax.tree.unflatten(treedef, leaves)
    return self._pull(s, vjp_fn, out_cots, result_cots)

  def backward(self, s: int, params, batch, acts, out_cots, result_cots):
    """``(param_grads, act_cots)``, recomputing the forward first.

    ``out_cots`` / ``result_cots`` may hold None for a zero cotangent;
    ``act_cots`` holds None for inputs that are not differentiable.
    """
    _, _, residuals = self._vjp(s, params, batch, acts)
    return self._pull(s, residuals, out_cots, result_cots)

  def forward_backward(self, s: int, params, batch, acts, result_cots):
    """``(results, param_grads, act_cots)`` of a stage with no outputs.

    The forward and its backward as one function (``jax.vjp`` and its
    pullback in one trace): jitted, XLA fuses across them and no residual
    leaves the program -- what ``jax.value_and_grad`` of the stage would
    compile to. Only for a stage whose values no later stage reads (the
    last one): its backward needs nothing but its own forward.
    """
    if self.specs[s].outputs:
      raise ValueError(
        f"stage {s} has outputs that later stages read: its backward needs "
        "their cotangents, so it cannot run fused with its forward"
      )
    _, results, vjp_fn = self._vjp(s, params, batch, acts)
    param_grads, act_cots = self._pull(s, vjp_fn, (), result_cots)
    return results, param_grads, act_cots

  def input_gradient(self, s: int, params, batch, acts, out_cots, result_cots):
    """The first half of ``backward`` (a zero-bubble schedule's I):
    ``(act_cots, kept)``, its input cotangents and what
    ``weight_gradient`` needs to finish it (``_backward_split.py``)."""
    args = (params, batch, acts, out_cots, result_cots)
    return self._split(s, self.backward, args).input_part(*args)

  def input_gradient_from_residuals(
    self, s: int, params, residuals, out_cots, result_cots
  ):
    """``input_gradient`` of ``backward_from_residuals``."""
    args = (params, residuals, out_cots, result_cots)
    split = self._split(s, self.backward_from_residuals, args)
    return split.input_part(*args)

  def weight_gradient(self, s: int, kept) -> tuple:
    """The second half (W): stage s's param gradients from the ``kept``
    values of its last traced ``input_gradient``."""
    if s not in self._weight_split:
      raise ValueError(f"stage {s}: call input_gradient before its W")
    return self._weight_split[s].weight_part(kept)

  def _split(self, s, backward, args) -> BackwardSplit:
    """Stage s's ``backward`` split at ``args``' shapes; kept for W."""
    split = split_backward(lambda *a: backward(s, *a), *args)
    self._weight_split[s] = split
    return split

  def jitted(self, kind: str, s: int):
    """``jax.jit`` of ``forward``/``backward``/... for stage s, cached."""
    key = (kind, s)
    if key not in self._jitted:
      fn = getattr(self, kind)
      self._jitted[key] = jax.jit(
        lambda *a: fn(s, *a), compiler_options=self.compiler_options or None
      )
    return self._jitted[key]


def _specs(
  traced: TracedModel, eqn_stage, num_stages, unread_params=(), carried=()
) -> list[StageSpec]:
  """Reads and writes of each stage; checks no value flows backwards.
  ``unread_params`` (param leaves nothing reads) go to the last stage; a
  ``carried`` result that is its model-state leaf returned as it came is
  no stage's (its holders keep the value)."""
  jaxpr = traced.jaxpr
  n_params = traced.num_param_leaves
  invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
  producer_stage: dict[Any, int] = {}
  eqns: list[list[int]] = [[] for _ in range(num_stages)]
  for i, (eqn, s) in enumerate(zip(jaxpr.eqns, eqn_stage, strict=True)):
    eqns[s].append(i)
    for v in eqn.outvars:
      if not isinstance(v, jcore.DropVar):
        producer_stage[v] = s
  params = [set() for _ in range(num_stages)]
  batch = [set() for _ in range(num_stages)]
  inputs: list[dict] = [{} for _ in range(num_stages)]
  consumers: dict[Any, set[int]] = {}

  def read(v, s):
    if isinstance(v, jcore.Literal):
      return
    if v in invar_index:
      i = invar_index[v]
      (params[s].add(i) if i < n_params else batch[s].add(i - n_params))
    elif v in producer_stage:
      src = producer_stage[v]
      if src > s:
        raise ValueError(
          f"stage {s} reads a value produced by later stage {src}: the "
          "node -> stage assignment must follow the model's data flow "
          "(stages numbered in topological order)"
        )
      if src < s:
        inputs[s][v] = None
        consumers.setdefault(v, set()).add(s)

  for s in range(num_stages):
    for i in eqns[s]:
      for v in jaxpr.eqns[i].invars:
        read(v, s)
  results: list[list[int]] = [[] for _ in range(num_stages)]
  last = num_stages - 1
  # (Frozen weights held as model state, NNX's non-``wrt`` params: read
  # where their layers run, never gathered on the last stage to be
  # returned unchanged.)
  unchanged = {
    r
    for leaf, r in carried
    if jaxpr.outvars[r] is jaxpr.invars[n_params + leaf]
  }
  for r, v in enumerate(jaxpr.outvars):
    if isinstance(v, jcore.Literal) or r in unchanged:
      continue
    if v in producer_stage:
      results[producer_stage[v]].append(r)
    else:  # An input or a constant returned as is: the last stage has it.
      results[last].append(r)
      read(v, last)
  # (Held so that they are stepped with a zero gradient, as one device's
  # optimizer steps them -- weight decay moves them -- and saved,
  # gathered and loaded with the rest. The last stage: under 1F1B it
  # stashes the fewest activations.)
  params[last].update(unread_params)
  loss_var = jaxpr.outvars[0]
  if traced.returns_loss and producer_stage.get(loss_var, last) != last:
    raise ValueError(
      f"the loss is computed on stage {producer_stage[loss_var]}, not on "
      f"the last stage {last}: give the last stage the loss's nodes (module "
      "calls after the loss, e.g. for aux outputs, are split after it: "
      "make them before the loss)"
    )
  specs = []
  for s in range(num_stages):
    outputs = tuple(v for v in consumers if producer_stage[v] == s)
    specs.append(
      StageSpec(
        eqns=tuple(eqns[s]),
        param_leaves=tuple(sorted(params[s])),
        batch_leaves=tuple(sorted(batch[s])),
        inputs=tuple(inputs[s]),
        outputs=outputs,
        results=tuple(results[s]),
      )
    )
  return specs


# A saving forward's residuals of at least this many bytes are returned as
# their own arrays, per platform (why: jpipe/runtime/build/flat.py, which
# takes the gradients' sizes from the same measurements).
RESIDUAL_OWN_BYTES = {"cpu": 1 << 14}
ACCELERATOR_RESIDUAL_OWN_BYTES = 1 << 20


def default_residual_own_bytes(platform: str) -> int:
  """The size from which a residual is its own array on ``platform``
  (``"cpu"``, ``"gpu"``, ``"tpu"``...)."""
  return RESIDUAL_OWN_BYTES.get(platform, ACCELERATOR_RESIDUAL_OWN_BYTES)


def _pack_residuals(leaves, params, own_bytes):
  """``(layout, residuals)``: per leaf ("param", i), ("big", j) or
  ("packed", dtype, offset, shape); residuals = big leaves (of at least
  ``own_bytes`` bytes), then one flat buffer per packed dtype."""
  param_ids = {id(p): i for i, p in enumerate(params)}
  layout, big, groups = [], [], {}
  for leaf in leaves:
    if id(leaf) in param_ids:
      layout.append(("param", param_ids[id(leaf)]))
      continue
    leaf = jnp.asarray(leaf)
    if leaf.size * leaf.dtype.itemsize >= own_bytes:
      layout.append(("big", len(big)))
      big.append(leaf)
      continue
    group = groups.setdefault(leaf.dtype, [])
    offset = sum(x.size for x in group)
    layout.append(("packed", leaf.dtype, offset, leaf.shape))
    group.append(leaf)
  dtypes = list(groups)
  packed = [jnp.concatenate([x.reshape(-1) for x in groups[d]]) for d in dtypes]
  layout = [
    ("packed", dtypes.index(e[1]), e[2], e[3]) if e[0] == "packed" else e
    for e in layout
  ]
  return tuple(layout), (*big, *packed)


def _unpack_residuals(layout, params, residuals):
  num_big = sum(1 for e in layout if e[0] == "big")
  leaves = []
  for entry in layout:
    if entry[0] == "param":
      leaves.append(params[entry[1]])
    elif entry[0] == "big":
      leaves.append(residuals[entry[1]])
    else:
      _, group, offset, shape = entry
      size = int(np.prod(shape, dtype=np.int64))
      flat = residuals[num_big + group][offset : offset + size]
      leaves.append(flat.reshape(shape))
  return leaves


def _inexact(dtype) -> bool:
  return bool(jnp.issubdtype(dtype, jnp.inexact))


def _cotangent(var, cot):
  """A cotangent for ``var``: zeros for None, float0 for integer values."""
  aval = var.aval
  if not _inexact(aval.dtype):
    return np.zeros(aval.shape, jax.dtypes.float0)
  if cot is None:
    return jnp.zeros(aval.shape, aval.dtype)
  return jnp.asarray(cot, aval.dtype)
