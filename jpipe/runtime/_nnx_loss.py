"""A Flax NNX model and a loss written the NNX way, as a Pipeline's loss.

NNX code trains ``loss_fn(model, batch)`` through ``nnx.value_and_grad``,
the model's variables living in the model. A :class:`~jpipe.Pipeline`
takes a pure function of arrays, so :func:`nnx_loss` splits the model
once (``nnx.split``) and returns the function that merges it back per
call (``nnx.merge``), as NNX's own functional training step does:

- the ``nnx.Param`` variables are the params (an ``nnx.State``), or
  those ``wrt`` selects (``nnx.LoRAParam``, as ``nnx.Optimizer(model, tx,
  wrt=...)`` and ``nnx.DiffState`` select them): the other params are
  then model state the loss returns as it got it, read where their layers
  run, with no gradient and no optimizer state (frozen);
- every other variable -- BatchNorm statistics, RNG streams
  (``nnx.Dropout(rngs=...)``'s key and count), a counter of your own -- is
  model state, passed in and returned updated by each microbatch's forward
  on the stage holding it, so dropout draws the masks NNX would draw
  calling the model microbatch by microbatch (values sown with
  ``Module.sow`` are dropped).

A model made with ``nnx.var_defaults(hijax=True)`` (its variables JAX
types of their own, not pytrees of arrays) is split as the same model
with ordinary variables (``array_variables``): the params are arrays.

After training, ``NnxLoss.write_back(model, pipe, state)`` writes the
results back into the model (``nnx.update`` with the gathered params and,
if the model has any, model state).
"""

from collections.abc import Callable
from typing import Any, NamedTuple


class NnxLoss(NamedTuple):
  """What :func:`nnx_loss` returns: ``Pipeline(loss_fn, params, batch,
  model_state=model_state, has_aux=...)``.

  Attributes:
    loss_fn: ``(params, batch) -> loss`` for a model with params only,
      else ``(params, model_state, batch) -> (loss, new_model_state)``
      (with ``has_aux``: ``(loss, aux)`` / ``(loss, (new_model_state,
      aux))``).
    params: the model's ``nnx.Param`` state.
    model_state: its other variables' state, or None if it has none.
  """

  loss_fn: Callable
  params: Any
  model_state: Any

  def write_back(self, model, pipe, state) -> None:
    """Writes ``pipe``'s trained params and model state (``state``, a
    drained pipeline's) into ``model`` in place, as ``nnx.update`` does;
    every process of a multi-process pipeline must call it."""
    from flax import nnx

    params = pipe.gather_params(state)
    model_state = pipe.gather_model_state(state)
    if model_state is None:  # (A model with params only.)
      nnx.update(model, params)
    else:
      nnx.update(model, params, model_state)


def nnx_loss(
  model, loss_fn: Callable, *, has_aux: bool = False, wrt: Any = None
) -> NnxLoss:
  """``loss_fn(model, batch)`` of an ``nnx.Module`` as a Pipeline's loss.

  Args:
    model: the NNX model (its current variables are the initial params
      and model state; it is not modified).
    loss_fn: ``(model, batch) -> loss`` (a scalar), or ``(loss, aux)``
      with ``has_aux``: written as for ``nnx.value_and_grad``; the model
      it gets is rebuilt from the pipeline's params and state each call
      (set ``model.train()`` / ``model.eval()`` before splitting).
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    wrt: an NNX filter of the variables to train (None: ``nnx.Param``),
      e.g. ``nnx.LoRAParam``: the rest are model state, the params it
      leaves out frozen.

  Returns:
    An :class:`NnxLoss`.
  """
  import jax
  from flax import nnx

  if not isinstance(model, nnx.Module):
    raise TypeError(
      f"nnx_loss takes an nnx.Module, got {type(model).__name__}; a linen "
      "model's loss is already a function of its params"
    )
  model = array_variables(nnx.clone(model))  # The caller's stays as it is.
  nnx.pop(model, nnx.Intermediate)  # Values sown by earlier calls.
  wrt = nnx.Param if wrt is None else wrt
  graphdef, params, state = nnx.split(model, wrt, ...)
  if not jax.tree.leaves(params):
    raise ValueError(
      f"wrt={wrt!r} selects none of the model's variables: nothing to "
      "train (nnx.Param, or a filter of the variables to train)"
    )
  if not jax.tree.leaves(state):

    def params_only(params, batch):
      return loss_fn(nnx.merge(graphdef, params), batch)

    return NnxLoss(params_only, params, None)

  def with_state(params, model_state, batch):
    # Fresh variables, made at this trace's level (NNX mutates no other):
    # a caller's transform may pass the state in untraced.
    fresh = jax.tree.map(lambda x: x, model_state)
    module = nnx.merge(graphdef, params, fresh)
    out = loss_fn(module, batch)
    *_, new_state = nnx.split(module, wrt, nnx.Intermediate, ...)
    if has_aux:
      loss, aux = out
      return loss, (new_state, aux)
    return out, new_state

  return NnxLoss(with_state, params, state)


def array_variables(model):
  """``model`` with its hijax variables (``nnx.var_defaults(hijax=True)``:
  each a JAX type of its own, which a pipeline cannot place or slice) as
  ordinary ones holding arrays, shared variables still shared; the model
  itself where it has none."""
  from flax import nnx

  return nnx.with_vars(model, hijax=False, ref=False, allow_duplicates=True)
