"""``Pipeline(frozen=patterns)``: frozen params held inside as model state,
whole params outside.

Inside, the pipeline is ``frozen_loss``'s (``_frozen_loss.py``): its
params are the trained leaves (None at the frozen ones), its model state
the frozen leaves (beside the loss's own state, if any), so no stage
computes, sends or steps a frozen leaf's gradient and none holds optimizer
state for it. Outside, every method keeps the caller's view: ``init``
takes the whole params, ``gather_params`` and ``state_dict`` give them
whole (a checkpoint has the layout of one saved without freezing, so
``init_from`` and evaluation read it alike), ``gather_model_state`` gives
the loss's own state, and the functions given to ``evaluate``,
``predict`` and ``generate`` get the whole params. ``FrozenParams`` makes
those conversions.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jpipe.runtime._frozen_loss import (
  FrozenLoss,
  frozen_loss,
  merge_trees,
  split_frozen,
)


class FrozenParams:
  """The conversions between a frozen-param pipeline's inside and its
  caller's view (module docstring).

  Args:
    loss_fn, params, model_state, has_aux: as ``jpipe.Pipeline`` takes
      them (the whole params).
    patterns: what ``frozen_loss`` takes: regular expressions finding the
      frozen leaves' ``"a/b/c"`` paths.
  """

  def __init__(
    self,
    loss_fn: Callable,
    params: Any,
    patterns: str | Sequence[str],
    model_state: Any = None,
    has_aux: bool = False,
  ):
    self.inner: FrozenLoss = frozen_loss(
      loss_fn, params, patterns, model_state=model_state, has_aux=has_aux
    )
    self.has_state = model_state is not None
    # Per param leaf, whether it is frozen (the whole params' tree).
    self.mask = jax.tree.map(
      lambda x: x is None, self.inner.params, is_leaf=lambda x: x is None
    )
    self._wrapped: dict[Callable, Callable] = {}

  def split(self, params, model_state=None) -> tuple[Any, Any]:
    """(the trained params, the pipeline's model state) of whole
    ``params`` and the loss's own ``model_state``."""
    trained, held = split_frozen(params, self.mask)
    return trained, (held, model_state) if self.has_state else held

  def whole(self, trained, state) -> tuple[Any, Any]:
    """(the whole params, the loss's own model state or None) of the
    pipeline's trained params and model state (None where this process
    has neither: both None)."""
    if trained is None:
      return None, None
    held, inner = state if self.has_state else (state, None)
    return merge_trees(trained, held), inner

  def loss_state(self, state) -> Any:
    """The loss's own model state (None without one) in the pipeline's
    model state."""
    return state[1] if self.has_state else None

  def state_dict_out(self, tree):
    """A state dict of the inside made the caller's: whole "params", the
    loss's own "model_state"."""
    if tree is None:
      return None
    params, state = self.whole(tree["params"], tree["model_state"])
    return {**tree, "params": params, "model_state": state}

  def state_dict_in(self, tree):
    """A state dict of the caller's view made the inside's."""
    params, state = self.split(tree["params"], tree.get("model_state"))
    return {**tree, "params": params, "model_state": state}

  def user_fn(self, fn: Callable | None) -> Callable | None:
    """``fn(params, [model_state,] batch)`` over whole params as the
    inside calls it, ``(trained, state, batch)``; one wrapper per ``fn``
    (the pipeline caches programs per function)."""
    if fn is None:
      return None
    if fn not in self._wrapped:

      def on_whole(trained, state, batch):
        params, inner = self.whole(trained, state)
        if self.has_state:
          return fn(params, inner, batch)
        return fn(params, batch)

      self._wrapped[fn] = on_whole
    return self._wrapped[fn]
