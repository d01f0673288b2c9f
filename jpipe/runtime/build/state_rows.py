"""Model state stacked per layer of a scan split by layer, held as rows.

A model whose layers are scanned keeps its per-layer model state stacked
like its params: BatchNorm statistics under ``nn.scan(...,
variable_axes={"params": 0, "batch_stats": 0})``, each layer's RNG
stream (key and count) of an NNX block made under ``nnx.vmap`` and run
by ``nnx.scan``. The pipeline splits the scan by layer
(``partition/_scan_layers.py``); held whole, such a leaf would be read
by every stage of the scan, which no microbatch order can keep exact
(``partition/_state_updates.py`` refuses it). Held as rows instead, each
row is read and written by its own layer's iteration, on that layer's
stage, in microbatch order: ``on_rows`` gives the loss the state as rows
(concatenated for the model, the new value sliced back after), and
``partition/_row_forwarding.py`` reads each row straight from its
iteration. What the user passes and gets (``init``, ``gather_model_state``,
``state_dict``) keeps the model's stacked layout (``StateRows``).
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jcore

from jpipe.partition import ParamLayout, axis_moved_first


def rows_read_by_layer(traced, inputs: Sequence[int]) -> dict[int, tuple]:
  """``{k: (rows, axis)}`` for the ``inputs`` (k-th of them, jaxpr input
  indices) that a scan split by layer alone reads, row by row (its
  per-iteration slices; of the input, or of a transpose moving its axis
  ``axis`` first, as ``nn.scan(variable_axes={...: axis})`` reads it),
  and that the function does not return as they came: a leaf stacked per
  layer."""
  if not traced.eqn_slices:
    return {}
  jaxpr = traced.jaxpr
  readers = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if isinstance(v, jcore.Var):
        readers.setdefault(v, []).append(i)

  def sliced(v) -> bool:
    read = readers.get(v, [])
    return bool(read) and all(traced.eqn_slices[i] is not None for i in read)

  out = {}
  for k, index in enumerate(inputs):
    v = jaxpr.invars[index]
    if v in jaxpr.outvars:
      continue
    if sliced(v):
      out[k] = v.aval.shape[0], 0
      continue
    read = readers.get(v, [])
    axis = axis_moved_first(jaxpr.eqns[read[0]]) if len(read) == 1 else 0
    if axis and sliced(jaxpr.eqns[read[0]].outvars[0]):
      out[k] = v.aval.shape[axis], axis
  return out


@dataclasses.dataclass(frozen=True)
class StateRows:
  """The pipeline's model-state leaves (rows of stacked ones) as the
  model's.

  Attributes:
    treedef: the model state's structure, as the model declares it.
    layout: per pipeline leaf, ``(model leaf, row)`` (row -1: whole).
  """

  treedef: Any
  layout: ParamLayout

  @classmethod
  def of(cls, model_state, rows: dict[int, tuple[int, int]]) -> "StateRows":
    """The rows of ``model_state``'s leaves ``{k: (rows, layer axis)}``
    (``rows_read_by_layer``)."""
    treedef = jax.tree.structure(model_state)
    source = [
      (k, r)
      for k in range(treedef.num_leaves)
      for r in (range(rows[k][0]) if k in rows else (-1,))
    ]
    axes = [rows[k][1] if k in rows else 0 for k in range(treedef.num_leaves)]
    return cls(
      treedef,
      ParamLayout(
        tuple(source), treedef.num_leaves, tuple(axes) if any(axes) else ()
      ),
    )

  def to_rows(self, model_state) -> list:
    """The model's state -> the pipeline's leaves (rows sliced)."""
    return self.layout.to_traced(jax.tree.leaves(model_state))

  def to_model(self, leaves) -> Any:
    """The pipeline's leaves (arrays, or abstract values) -> the model's
    state (rows stacked)."""
    return jax.tree.unflatten(self.treedef, self.layout.to_model(leaves))

  def on_rows(self, loss_fn, has_aux: bool):
    """``loss_fn(params, model_state, batch)`` taking and returning the
    state as the pipeline's leaves."""

    def by_rows(params, rows, batch):
      out = loss_fn(params, self.to_model(rows), batch)
      loss, rest = out
      if has_aux:
        new, aux = rest
        return loss, (self.to_rows(new), aux)
      return loss, self.to_rows(rest)

    return by_rows

  def reading_rows(self, fn):
    """``fn(params, model_state, batch)`` (an evaluation, a decoding
    step) taking the state as the pipeline's leaves."""

    def by_rows(params, rows, *rest):
      return fn(params, self.to_model(rows), *rest)

    return by_rows
