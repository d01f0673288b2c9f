"""Frozen params held as model state: no gradient, no optimizer state.

``jpipe.train.pretrained.freeze(tx, patterns)`` gives the frozen leaves
zero updates, but every stage still computes their gradients (a tied
embedding's: a [vocab, d] matmul and scatter per microbatch) and packs,
accumulates and, when tied across stages, sends them. :func:`frozen_loss`
instead makes them model state that the loss returns as it got it: each
is read where its layers run (``partition/_stages.py`` gives a state leaf
returned unchanged to no stage), is no input the stages differentiate,
and has no optimizer state. Measured with a 4-layer GPT whose tied
16,384-token embedding is frozen, on 2 CPU stages: a 1F1B step takes
0.79-0.83x the time of the same step under ``freeze``
(``experiments/runtime/frozen_params.py``; experiments/RESULTS.md,
"Frozen params as model state").

The trained params keep the model's structure, with None where a frozen
leaf was (an empty subtree to JAX), so ``gather_params`` gives that tree
and :meth:`FrozenLoss.merged` puts the frozen leaves back.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from jpipe.runtime.build.stage_optimizer import leaf_names, path_patterns


class FrozenLoss(NamedTuple):
  """What :func:`frozen_loss` returns: ``Pipeline(loss_fn, params, batch,
  model_state=model_state, has_aux=...)``.

  Attributes:
    loss_fn: ``(params, model_state, batch) -> (loss, new_model_state)``
      (with ``has_aux``: ``(loss, (new_model_state, aux))``).
    params: the trained params: the model's tree, None at frozen leaves.
    model_state: ``(frozen, model_state)`` where the loss had model state,
      else ``frozen``: the frozen leaves in the model's tree, None at the
      trained ones.
    has_state: whether ``model_state`` holds the loss's own state too.
  """

  loss_fn: Callable
  params: Any
  model_state: Any
  has_state: bool

  def merged(self, params, model_state=None) -> Any:
    """The whole params from the pipeline's (``gather_params``) and its
    model state (``gather_model_state``; None: the frozen leaves as they
    started, which no step changes); with the loss's own model state,
    ``(params, that state)``."""
    state = self.model_state if model_state is None else model_state
    frozen, inner = state if self.has_state else (state, None)
    whole = merge_trees(params, frozen)
    return (whole, inner) if self.has_state else whole


def frozen_loss(
  loss_fn: Callable,
  params,
  patterns: str | Sequence[str],
  *,
  model_state=None,
  has_aux: bool = False,
) -> FrozenLoss:
  """``loss_fn`` with the params whose ``"a/b/c"`` path a pattern finds
  (``re.search``) held as model state, unchanged by training.

  Args:
    loss_fn: ``(params, batch) -> loss``, or with ``model_state``
      ``(params, model_state, batch) -> (loss, new_model_state)``; with
      ``has_aux`` the loss is ``(loss, aux)`` as ``Pipeline`` takes it.
    params: the model's params.
    patterns: regular expressions (a list, or one comma-separated string),
      e.g. ``"wte/"``, as ``jpipe.train.pretrained.freeze`` takes them.
    model_state: the loss's own model state, if it has one.
    has_aux: ``loss_fn`` returns aux outputs (``Pipeline``'s ``has_aux``).

  Raises:
    ValueError: a pattern is not a regular expression, or the patterns
      find no leaf, or every leaf.
  """
  trained, frozen = split_frozen(params, _frozen_mask(params, patterns))
  has_state = model_state is not None

  def with_frozen(trained, state, batch):
    held, inner = state if has_state else (state, None)
    whole = merge_trees(trained, held)
    if not has_state:
      out = loss_fn(whole, batch)
      loss, aux = out if has_aux else (out, None)
      return (loss, (held, aux)) if has_aux else (loss, held)
    loss, rest = loss_fn(whole, inner, batch)
    new, aux = rest if has_aux else (rest, None)
    return (loss, ((held, new), aux)) if has_aux else (loss, (held, new))

  state = (frozen, model_state) if has_state else frozen
  return FrozenLoss(with_frozen, trained, state, has_state)


def _frozen_mask(params, patterns) -> Any:
  """``params``' tree of booleans: whether a pattern finds the leaf."""
  compiled = path_patterns(patterns)
  names = leaf_names(params)
  hits = [any(c.search(n) for c in compiled) for n in names]
  if not any(hits):
    raise ValueError(
      f"no param path matches {[c.pattern for c in compiled]} (paths look like "
      f"{names[0]!r}): nothing to freeze"
    )
  if all(hits):
    raise ValueError(
      f"{[c.pattern for c in compiled]} match every param: nothing would train"
    )
  return jax.tree.unflatten(jax.tree.structure(params), hits)


def split_frozen(params, mask) -> tuple[Any, Any]:
  """(the params with None at the leaves ``mask`` marks, the params with
  None at the others): the trained and the frozen."""
  trained = jax.tree.map(lambda x, f: None if f else x, params, mask)
  frozen = jax.tree.map(lambda x, f: x if f else None, params, mask)
  return trained, frozen


def merge_trees(trained, frozen) -> Any:
  """One tree of the two, each leaf from the one that has it."""
  return jax.tree.map(
    lambda t, f: f if t is None else t,
    trained,
    frozen,
    is_leaf=lambda x: x is None,
  )
