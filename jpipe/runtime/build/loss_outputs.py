"""What a Pipeline's ``loss_fn`` returns, checked against what it was
built for, and where each of its flat results goes.

``loss_fn`` returns, by the Pipeline's options:

=====================  ==========================================
model_state, has_aux   returns
=====================  ==========================================
neither                ``loss``
has_aux                ``(loss, aux)``
model_state            ``(loss, new_model_state)``
both                   ``(loss, (new_model_state, aux))``
=====================  ==========================================

``loss`` is a scalar; ``aux`` any pytree of arrays (metrics beside the
loss: an accuracy, a count). Flattened, the results are the loss, the
model-state leaves, then the aux leaves: result 0, results ``1 ..
num_state``, results ``num_state + 1 ..``.
"""

import dataclasses
import inspect
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class LossOutputs:
  """The structure of ``loss_fn``'s results.

  Attributes:
    num_state_leaves: leaves of the model state (0: none).
    state_treedef: the model state's structure, or None.
    aux_treedef: the aux pytree's structure, or None (no ``has_aux``).
  """

  num_state_leaves: int = 0
  state_treedef: Any = None
  aux_treedef: Any = None

  @property
  def num_aux_leaves(self) -> int:
    return 0 if self.aux_treedef is None else self.aux_treedef.num_leaves

  @property
  def first_aux(self) -> int:
    """The flat result index of the first aux leaf."""
    return 1 + self.num_state_leaves


def loss_outputs(out_tree, model_state, has_aux: bool) -> LossOutputs:
  """``out_tree`` (the traced loss's output structure; its loss already
  checked to be a scalar) checked against the options: the results'
  ``LossOutputs``, or a ValueError saying what ``loss_fn`` must return."""
  out = jax.tree.unflatten(out_tree, [0] * out_tree.num_leaves)
  state_treedef = None
  if model_state is not None:
    state_treedef = jax.tree.structure(model_state)
  if model_state is None:
    if not has_aux:
      return LossOutputs()
    return LossOutputs(aux_treedef=jax.tree.structure(out[1]))
  rest = out[1]
  if has_aux:
    if not (isinstance(rest, tuple) and len(rest) == 2):
      raise ValueError(
        "with model_state= and has_aux=True, loss_fn(params, model_state, "
        "batch) must return (loss, (new_model_state, aux)); its second "
        f"output is {type(rest).__name__}, not a pair"
      )
    rest, aux = rest
  if jax.tree.structure(rest) != state_treedef:
    raise ValueError(
      "with model_state=, loss_fn(params, model_state, batch) must return "
      f"(loss, {'(new_model_state, aux)' if has_aux else 'new_model_state'})"
      " with new_model_state structured like model_state"
    )
  return LossOutputs(
    num_state_leaves=state_treedef.num_leaves,
    state_treedef=state_treedef,
    aux_treedef=jax.tree.structure(aux) if has_aux else None,
  )


def loss_output_message(got, model_state, has_aux: bool) -> str:
  """What a Pipeline's loss_fn returns (it returned ``got``)."""
  if model_state is None:
    want = "loss_fn(params, batch) returns "
    want += "(loss, aux)" if has_aux else "the loss alone"
  else:
    want = "with model_state=, loss_fn(params, model_state, batch) returns "
    want += (
      "(loss, (new_model_state, aux))"
      if has_aux
      else ("(loss, new_model_state)")
    )
  if has_aux:
    return (
      f"loss_fn returned {got}; with has_aux=True a Pipeline's {want}, the "
      "loss a scalar"
    )
  return (
    f"loss_fn returned {got}; a Pipeline's {want}, the loss a scalar. For "
    "metrics beside the loss pass has_aux=True (step's metrics['aux']: "
    "their means over the microbatches) or a metrics_fn to pipe.evaluate"
  )


def check_loss_arguments(loss_fn, model_state) -> None:
  """Refuses a ``loss_fn`` whose signature takes the other calling
  convention: ``(params, model_state, batch)`` without ``model_state=``
  or ``(params, batch)`` with it (what ``jpipe.nnx_loss`` returns takes
  the first). A signature Python cannot read is left to the trace."""
  if not callable(loss_fn):
    if hasattr(loss_fn, "loss_fn"):  # (jpipe.nnx_loss's NnxLoss.)
      raise TypeError(
        f"loss_fn is a {type(loss_fn).__name__}, not a function: pass its "
        "parts, Pipeline(nl.loss_fn, nl.params, batch, "
        "model_state=nl.model_state)"
      )
    raise TypeError(f"loss_fn must be a function, got {type(loss_fn).__name__}")
  try:
    signature = inspect.signature(loss_fn)
  except (TypeError, ValueError):
    return
  given, other = (2, 3) if model_state is None else (3, 2)
  if _takes(signature, given) or not _takes(signature, other):
    return
  if model_state is None:
    raise ValueError(
      "loss_fn takes (params, model_state, batch) but no model_state was "
      "given: pass model_state= (the initial model state; "
      "jpipe.nnx_loss's .model_state)"
    )
  raise ValueError(
    "model_state= was given but loss_fn takes (params, batch): with model "
    "state, loss_fn(params, model_state, batch) returns (loss, "
    "new_model_state); or drop model_state="
  )


def check_argument_leaves(params, model_state) -> None:
  """Refuses params or model state with a leaf that is no array (an NNX
  hijax variable or array reference, ``nnx.var_defaults(hijax=True)``,
  split by hand: the stages place and slice arrays), naming it and the
  fix."""
  for name, tree in (("params", params), ("model_state", model_state)):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if not _array_like(leaf):
        raise ValueError(
          f"{name} leaf {jax.tree_util.keystr(path)} is of type "
          f"{type(leaf).__name__}, not an array: params and model state "
          "hold arrays; for an NNX model of hijax variables or array "
          "references use jpipe.nnx_loss(model, loss_fn), or split "
          "nnx.with_vars(model, hijax=False, ref=False)"
        )


def _array_like(x) -> bool:
  """An array, an abstract one, or a leaf that becomes one when read (a
  lazily read checkpoint tensor: ``shape``, ``dtype``, ``__array__``);
  not a JAX type of another kind (a hijax variable, a reference)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return True
  try:
    return isinstance(jax.typeof(x), jax.core.ShapedArray)
  except TypeError:  # (No JAX type: an array once read, or nothing.)
    return all(hasattr(x, a) for a in ("shape", "dtype", "__array__"))


def _takes(signature, count: int) -> bool:
  """Whether a call with ``count`` positional arguments binds."""
  try:
    signature.bind(*range(count))
  except TypeError:
    return False
  return True
