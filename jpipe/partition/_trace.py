"""Trace ``loss_fn(params, batch)`` into a graph of module-call nodes.

The loss is traced to a jaxpr once. Equations are grouped into nodes by the
module path recorded in their name stack (Flax linen pushes one scope per
module call; for NNX the tracer pushes them, see ``_nnx_scopes``; plain JAX
code can use ``jax.named_scope``), cut at ``depth``
path components below the root module. A node is a maximal run of
consecutive equations with the same path prefix, so a module called twice
(a tied embedding used as the output head) gives two nodes, and the nodes'
program order is a topological order. Equations outside any module (input
reshapes, the loss itself) join the run before them; those reading only
the function's inputs (a slice of the batch, a mask made from it) join the
run after them, whose work they are -- and those reading params among
them (params cast to the compute dtype at the loss's top) first move to
just before their first reader (``_input_glue``).

A scan over layers (stacked params scanned by a ``scan`` whose carry
flows layer to layer: linen's ``nn.scan``, ``jax.lax.scan`` over stacked
params) becomes one node per iteration, each reading its rows of the
stacked params (``_scan_layers``; ``param_layout`` maps the rows back to
the model's leaves). A ``jax.checkpoint`` (``nn.remat``) whose work spans
nodes at the depth cut is split into one checkpoint per node
(``_checkpoint_split``). Other ``scan``, ``cond`` and ``while``
equations stay inside one node; to cut inside them, unroll the loop in the
model or call the repeated module outside the control flow. Nested
``jax.jit`` calls spanning modules (a jitted loss) are opened first
(``_inline_calls``). The loss is traced on the caller's mesh with its
arrays typed as the caller typed them (``_caller_axes``), so that
annotations naming the mesh trace, then retyped to plain arrays with its
sharding constraints dropped (``_plain_types``).
"""

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np

from jpipe.partition import _flops
from jpipe.partition._caller_axes import caller_axes
from jpipe.partition._checkpoint_split import deep_paths, split_checkpoints
from jpipe.partition._indexed_loops import indexed_loops_as_scans
from jpipe.partition._inline_calls import inline_module_calls
from jpipe.partition._input_glue import sink_input_glue
from jpipe.partition._nested_scans import nested_scans_as_one
from jpipe.partition._nnx_scopes import nnx_module_scopes
from jpipe.partition._plain_types import plain_types
from jpipe.partition._scan_layers import ParamLayout, split_layer_scans
from jpipe.partition._scopes import (
  components,
  eqn_scope,
  inputs_glue_joins_next,
  nested_paths,
)


@dataclasses.dataclass(frozen=True, eq=False)
class TracedModel:
  """A traced loss and its equation-to-node grouping.

  Attributes:
    closed_jaxpr: the loss as a closed jaxpr over the flat (params, batch)
      leaves (params first).
    in_tree: treedef of ``(params, batch)``.
    out_tree: treedef of the loss function's output.
    num_param_leaves: how many leading jaxpr inputs are parameters (a
      stacked leaf scanned over layers counts as its rows).
    leaf_paths: ``jax.tree_util.keystr`` path of every input leaf (a row
      of a stacked leaf: its path + ``[k]``).
    node_names: module path of each node, unique (repeated calls get
      ``#2``, ``#3``...).
    eqn_node: node index of every equation, non-decreasing.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    depth: the module-path depth the nodes were cut at.
    eqn_scopes: every equation's module path below the root (so another
      depth regroups without tracing again: ``at_depth``).
    returns_loss: whether the function's first output is a scalar loss
      (False: any pytree of arrays, a function run forward only).
    param_layout: the traced param leaves as rows of the model's leaves
      (None: the same leaves).
    eqn_iteration: per equation, ``(scan, k)`` when it is iteration k of a
      scan over layers (``_scan_layers``), else None; () without any.
    eqn_slices: per equation, the scan it slices a scanned input for.
    whole: the trace before any checkpoint was split for a depth
      (``at_depth`` cuts from it).
  """

  closed_jaxpr: jcore.ClosedJaxpr
  in_tree: Any
  out_tree: Any
  num_param_leaves: int
  leaf_paths: tuple[str, ...]
  node_names: tuple[str, ...]
  eqn_node: tuple[int, ...]
  has_aux: bool
  depth: int = 1
  eqn_scopes: tuple[tuple[str, ...], ...] = ()
  returns_loss: bool = True
  param_layout: ParamLayout | None = None
  eqn_iteration: tuple[tuple[int, int] | None, ...] = ()
  eqn_slices: tuple[int | None, ...] = ()
  whole: "_Whole | None" = None

  def traced_params(self, params) -> list:
    """The model's params pytree as the traced param leaves (rows of
    stacked leaves sliced)."""
    leaves = jax.tree.leaves(params)
    if self.param_layout is None:
      return leaves
    return self.param_layout.to_traced(leaves)

  def model_leaves(self, leaves) -> list:
    """Traced param leaves -> the model's leaves (rows stacked)."""
    if self.param_layout is None:
      return list(leaves)
    return self.param_layout.to_model(leaves)

  @property
  def num_nodes(self) -> int:
    return len(self.node_names)

  @property
  def max_depth(self) -> int:
    """The deepest module path of any equation: deeper cuts add no
    nodes."""
    if self.whole is not None:  # (Paths inside checkpoints count.)
      return self.whole.deepest
    return max((len(s) for s in self.eqn_scopes), default=1) or 1

  def at_depth(self, depth: int) -> "TracedModel":
    """The same trace with its nodes cut at another depth (no retrace:
    linear in the number of equations), checkpoints split where their
    work spans nodes there."""
    if depth < 1:
      raise ValueError(f"depth must be >= 1, got {depth}")
    whole = self.whole
    if whole is None:
      names, eqn_node = _group(self.eqn_scopes, depth)
      return dataclasses.replace(
        self, node_names=tuple(names), eqn_node=tuple(eqn_node), depth=depth
      )
    cut = whole.split_at(depth)
    scopes = inputs_glue_joins_next(
      cut.closed_jaxpr.jaxpr.eqns, [p[whole.strip :] for p in cut.paths]
    )
    names, eqn_node = _group(scopes, depth)

    def per_eqn(values):
      return tuple(values[i] for i in cut.origin) if values else ()

    return dataclasses.replace(
      self,
      closed_jaxpr=cut.closed_jaxpr,
      node_names=tuple(names),
      eqn_node=tuple(eqn_node),
      depth=depth,
      eqn_scopes=tuple(scopes),
      eqn_iteration=per_eqn(whole.iteration),
      eqn_slices=per_eqn(whole.slices),
    )

  @property
  def jaxpr(self) -> jcore.Jaxpr:
    return self.closed_jaxpr.jaxpr

  def node_eqns(self, node: int) -> list[int]:
    """Indices of the equations of ``node``."""
    return [i for i, n in enumerate(self.eqn_node) if n == node]

  def producers(self) -> dict[Any, int]:
    """Var -> index of the node that produces it (equation outputs only)."""
    out = {}
    for eqn, node in zip(self.jaxpr.eqns, self.eqn_node, strict=True):
      for v in eqn.outvars:
        if not isinstance(v, jcore.DropVar):
          out[v] = node
    return out

  def node_param_leaves(self) -> list[set[int]]:
    """Per node, the indices of the parameter leaves its equations read."""
    params = {
      v: i for i, v in enumerate(self.jaxpr.invars[: self.num_param_leaves])
    }
    used = [set() for _ in self.node_names]
    for eqn, node in zip(self.jaxpr.eqns, self.eqn_node, strict=True):
      for v in eqn.invars:
        if not isinstance(v, jcore.Literal) and v in params:
          used[node].add(params[v])
    return used

  def unread_param_leaves(self) -> tuple[int, ...]:
    """The parameter leaves no equation reads and the function does not
    return (a model's unused head, HF Dinov2's ``mask_token`` in
    classification): a pipeline's last stage holds them."""
    read = set().union(*self.node_param_leaves())
    read |= {v for v in self.jaxpr.outvars if not isinstance(v, jcore.Literal)}
    invars = self.jaxpr.invars[: self.num_param_leaves]
    return tuple(
      i for i, v in enumerate(invars) if i not in read and v not in read
    )

  def edges(self) -> dict[tuple[int, int], int]:
    """(producer node, consumer node) -> bytes of the distinct values sent."""
    producer = self.producers()
    sent: dict[tuple[int, int], set] = {}
    for eqn, node in zip(self.jaxpr.eqns, self.eqn_node, strict=True):
      for v in eqn.invars:
        if isinstance(v, jcore.Literal) or v not in producer:
          continue
        src = producer[v]
        if src != node:
          sent.setdefault((src, node), set()).add(v)
    return {k: sum(_nbytes(v.aval) for v in vs) for k, vs in sent.items()}

  def node_flops(self) -> np.ndarray:
    """Forward FLOPs of each node (analytic count), float64 [num_nodes]."""
    flops = np.zeros(self.num_nodes)
    for eqn, node in zip(self.jaxpr.eqns, self.eqn_node, strict=True):
      flops[node] += _flops.eqn_flops(eqn)
    return flops

  def node_param_bytes(self) -> np.ndarray:
    """Bytes of the parameters each node reads, float64 [num_nodes].

    A parameter read by several nodes counts in each of them.
    """
    avals = [v.aval for v in self.jaxpr.invars[: self.num_param_leaves]]
    return np.array(
      [
        sum(_nbytes(avals[i]) for i in leaves)
        for leaves in self.node_param_leaves()
      ],
      np.float64,
    )

  def node_intermediate_bytes(self) -> np.ndarray:
    """Bytes of every value each node's equations compute, for one
    microbatch [num_nodes]: what a backward of the node may hold (an upper
    bound; XLA fuses and frees some)."""
    out = np.zeros(self.num_nodes)
    for eqn, node in zip(self.jaxpr.eqns, self.eqn_node, strict=True):
      out[node] += sum(
        _nbytes(v.aval) for v in eqn.outvars if hasattr(v.aval, "shape")
      )
    return out

  def node_output_bytes(self) -> np.ndarray:
    """Bytes of the values each node sends to later nodes [num_nodes]."""
    out = np.zeros(self.num_nodes)
    for (src, _), nbytes in self.edges().items():
      out[src] += nbytes
    return out


def with_model_state(loss_fn, batch, model_state):
  """A loss with model state as one ``trace`` can take.

  Args:
    loss_fn: ``(params, model_state, batch) -> (loss, new_model_state)``.
    batch: its batch (a microbatch).
    model_state: e.g. BatchNorm statistics.

  Returns:
    (``(params, inputs) -> (loss, new_model_state)``, inputs): trace it with
    ``has_aux=True``. Dict keys flatten sorted, so the batch leaves come
    first, then the state leaves.
  """

  def traced_loss(params, inputs):
    return loss_fn(params, inputs["state"], inputs["batch"])

  return traced_loss, {"batch": batch, "state": model_state}


def trace(
  loss_fn: Callable[..., Any],
  params: Any,
  batch: Any,
  *,
  depth: int = 1,
  has_aux: bool = False,
  nnx_roots: Sequence[Any] = (),
  returns_loss: bool = True,
) -> TracedModel:
  """Traces ``loss_fn(params, batch)`` and groups it into module nodes.

  Args:
    loss_fn: returns a scalar loss, or ``(loss, aux)`` with ``has_aux``.
    params: example parameters (arrays or ShapeDtypeStructs).
    batch: example batch.
    depth: how many module-path components below the root define a node
      (1: the root's direct children; 2: their children, ...).
    has_aux: ``loss_fn`` returns ``(loss, aux)`` (e.g. BatchNorm statistics).
    nnx_roots: Flax NNX modules that ``loss_fn`` calls directly (closed
      over). Modules that ``loss_fn`` builds with ``nnx.merge`` are found by
      themselves; linen needs nothing.
    returns_loss: False for a function returning any pytree of arrays
      (metrics, predictions): it is run forward only, never
      differentiated.

  Returns:
    The traced model.
  """
  if depth < 1:
    raise ValueError(f"depth must be >= 1, got {depth}")
  leaves_with_paths, in_tree = jax.tree_util.tree_flatten_with_path(
    (params, batch)
  )
  leaves = [leaf for _, leaf in leaves_with_paths]
  num_param_leaves = len(jax.tree.leaves(params))

  def flat_loss(*flat):
    return loss_fn(*jax.tree.unflatten(in_tree, flat))

  with nnx_module_scopes(*nnx_roots), caller_axes(leaves) as typed:
    closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(*typed)
  out_tree = jax.tree.structure(out_shape)
  if returns_loss:
    _check_loss(out_shape, has_aux)
  closed = inline_module_calls(closed)  # (A jitted loss: its body.)
  closed = plain_types(closed)  # (Stages place values: no annotations.)
  # (A fori_loop reading row i of stacked params: a scan over the rows.)
  closed = indexed_loops_as_scans(closed, num_param_leaves)
  # (nn.remat_scan's scan in a scan: one scan over every layer.)
  closed = nested_scans_as_one(closed, num_param_leaves)
  split = split_layer_scans(closed, num_param_leaves, _scan_name)
  closed = split.closed_jaxpr
  if not closed.jaxpr.eqns:
    raise ValueError("loss_fn traced to no equations: nothing to partition")
  scopes = tuple(
    own if own is not None else eqn_scope(e)
    for e, own in zip(closed.jaxpr.eqns, split.scopes, strict=True)
  )
  # (Params cast at the loss's top: each cast with its layer.)
  closed, scopes, iteration, slices = _sunk(closed, scopes, split)
  deep = deep_paths(closed.jaxpr, scopes)
  strip = _root_strip(deep)
  paths = [jax.tree_util.keystr(p) for p, _ in leaves_with_paths]
  layout = None if split.layout.identity else split.layout
  if layout is not None:
    paths = [*layout.traced_names(paths), *paths[num_param_leaves:]]
  whole = _Whole(
    closed_jaxpr=closed,
    scopes=scopes,
    iteration=iteration if layout is not None else (),
    slices=slices if layout is not None else (),
    strip=strip,
    deepest=max((len(s) - strip for s in deep), default=1) or 1,
  )
  return TracedModel(
    closed_jaxpr=closed,
    in_tree=in_tree,
    out_tree=out_tree,
    num_param_leaves=len(split.layout.source),
    leaf_paths=tuple(paths),
    node_names=(),
    eqn_node=(),
    has_aux=has_aux,
    returns_loss=returns_loss,
    param_layout=layout,
    whole=whole,
  ).at_depth(depth)


@dataclasses.dataclass(frozen=True, eq=False)
class _Whole:
  """A trace before checkpoints are split for a depth.

  Attributes:
    closed_jaxpr: the traced loss, checkpoints whole.
    scopes: every equation's full module path (root's name included).
    iteration, slices: ``TracedModel.eqn_iteration`` / ``eqn_slices`` of
      these equations.
    strip: leading path components that are the root module's name (1
      where one module holds everything, else 0).
    deepest: the deepest path below the root, checkpoints' bodies in.
  """

  closed_jaxpr: jcore.ClosedJaxpr
  scopes: tuple[tuple[str, ...], ...]
  iteration: tuple
  slices: tuple
  strip: int
  deepest: int
  # Per depth, its split (made once: every cut at a depth is the same
  # jaxpr, its variables too).
  _splits: dict = dataclasses.field(default_factory=dict, repr=False)

  def split_at(self, depth: int):
    """``split_checkpoints`` of this trace at ``depth``."""
    if depth not in self._splits:
      self._splits[depth] = split_checkpoints(
        self.closed_jaxpr, self.scopes, depth, self.strip
      )
    return self._splits[depth]


class LossOutputError(ValueError):
  """``loss_fn`` returned something other than what ``trace`` was told
  (a scalar; with ``has_aux``, a scalar and aux). ``got``: the output's
  abstract value, for a caller's own message."""

  def __init__(self, message: str, got):
    super().__init__(message)
    self.got = got


def _check_loss(out_shape, has_aux: bool) -> None:
  """A loss function's output: a scalar, or (a scalar, aux)."""
  if has_aux and not (isinstance(out_shape, tuple) and len(out_shape) == 2):
    raise LossOutputError(
      "has_aux=True needs loss_fn to return (loss, aux)", out_shape
    )
  loss_shape = out_shape[0] if has_aux else out_shape
  if not hasattr(loss_shape, "shape") or loss_shape.shape != ():
    raise LossOutputError(
      f"loss_fn must return a scalar loss{' first' if has_aux else ''}; "
      f"got {loss_shape} (pass has_aux=True for (loss, aux))",
      out_shape,
    )


def _scan_name(eqn) -> tuple[tuple[str, ...], str]:
  """``(outer path, base name)`` of a scan over layers' iterations: the
  module the body runs in (``nn.scan``'s name), else ``"scan"``."""
  outer = components(eqn.source_info.name_stack)
  inner = [
    s
    for j in jcore.jaxprs_in_params(eqn.params)
    for s in nested_paths(j, glue=True)
  ]
  common = os.path.commonprefix(inner) if inner else ()
  return outer, common[0] if common else "scan"


def _sunk(closed, scopes, split):
  """``sink_input_glue`` on the split trace: (closed, scopes, iteration,
  slices) in the new order (a split scan's own equations stay)."""
  fixed = [
    it is not None or sl is not None
    for it, sl in zip(split.iteration, split.slices, strict=True)
  ]
  closed, order = sink_input_glue(
    closed, scopes, fixed, len(split.layout.source)
  )
  return (
    closed,
    tuple(scopes[i] for i in order),
    tuple(split.iteration[i] for i in order),
    tuple(split.slices[i] for i in order),
  )


def _root_strip(scopes) -> int:
  """1 where one root module holds everything (its children are depth
  1), else 0."""
  roots = {s[0] for s in scopes if s}
  return 1 if len(roots) == 1 and any(len(s) > 1 for s in scopes) else 0


def _group(
  scopes: Sequence[tuple[str, ...]], depth: int
) -> tuple[list[str], list[int]]:
  """Node names and the node of every equation (see the module doc)."""
  keys = ["/".join(s[:depth]) if s else None for s in scopes]
  names, eqn_node, counts = [], [], {}
  current = None
  for key in keys:
    if key is not None and key != current:
      counts[key] = counts.get(key, 0) + 1
      names.append(key if counts[key] == 1 else f"{key}#{counts[key]}")
      current = key
    eqn_node.append(len(names) - 1)
  if not names and scopes:
    names = ["model"]
  # Leading glue (before any module) joins the first node.
  eqn_node = [max(n, 0) for n in eqn_node]
  return names, eqn_node


def _nbytes(aval) -> int:
  return int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize
