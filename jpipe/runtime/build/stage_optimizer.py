"""Per-stage optimizer functions; their state keyed by model-global path.

A stage holds a tuple of parameter leaves. Its optimizer (and Gap-Aware,
and the weight predictor) sees them in the model's own params structure,
other stages' leaves None (``params_view``), so optax masks and labels
given for the whole model apply as on one device. What it keeps is
stored with every params-shaped part a dict keyed by the leaf's path in
the full params pytree (e.g. ``"params/dense_0/kernel"``), so the states
of all stages merge into the state of one optimizer over the whole model
-- what a checkpoint stores, and what a different partition can split
again. (Without a ``ParamsView`` the optimizer sees that ``{path: leaf}``
dict itself.)
"""

import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jpipe import staleness
from jpipe.runtime.build.flat import FlatLayout, PackedTree
from jpipe.runtime.build.grad_dtype import promoted_state
from jpipe.runtime.build.packed_steps import PackedSteps
from jpipe.runtime.build.params_view import KeyedLeaves, ParamsView
from jpipe.runtime.build.stage_keys import stage_keyed
from jpipe.runtime.build.stored_params import leaves_of, stored_params_like


def leaf_names(params: Any) -> tuple[str, ...]:
  """``"a/b/c"`` path of every leaf of ``params``, in flatten order."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  names = tuple(path_name(path) for path, _ in flat)
  if len(set(names)) != len(names):  # Keys that print alike: keep them apart.
    names = tuple(jax.tree_util.keystr(path) for path, _ in flat)
  return names


def path_patterns(patterns: str | Sequence[str]) -> list[re.Pattern]:
  """Compiled regular expressions for ``leaf_names``' paths, from a list
  or one comma-separated string; a ValueError names a bad one."""
  if isinstance(patterns, str):
    patterns = [p for p in patterns.split(",") if p.strip()]
  try:
    return [re.compile(p.strip()) for p in patterns]
  except re.error as e:
    raise ValueError(f"bad parameter path pattern {e.pattern!r}: {e}") from e


def path_name(path) -> str:
  """``"a/b/c"`` for a ``tree_flatten_with_path`` key path (dict keys,
  attribute names and sequence indices, each as itself)."""
  return "/".join(_key_name(k) for k in path)


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


class StageOptimizer(PackedSteps):
  """The jitted optimizer step and weight prediction of one stage.

  Args:
    names: global path of each leaf the optimizer manages.
    positions: where those leaves sit in the stage's tuple (default: all,
      in order); the others (replicas of tied params another stage owns)
      pass through its update and prediction unchanged.
    tx: the optax optimizer.
    gap_aware: ``staleness.gap_aware`` options (a dict) when this stage
      applies Gap-Aware, else None.
    predictor: a ``staleness.Predictor`` when the stage predicts weights.
    learning_rate_schedule: with a closed-form predictor, the schedule whose
      future values make the prediction scheduler-aware.
    horizon: the largest delay this stage predicts over (static).
    grad_layout: a ``FlatLayout`` of the stage's leaves; with it,
      ``update_packed`` / ``predict_packed`` take the gradient as that
      layout's flat buffers and unpack it inside their own program (one
      call fewer, and ~30 fewer arrays through the host, per step).
    compiler_options: XLA options of its programs (``jax.jit``'s).
    state_own_bytes: with it, the optimizer state is stored packed
      (``init`` and every step return a ``PackedTree``: leaves of at
      least this many bytes apart, the rest one buffer per width; a
      stage's Adam state is then ~1 array where it was twice its leaves
      and a count, each a few microseconds of every step's dispatch).
      None: stored as optax's tree. ``state_tree`` reads either.
    view: the leaves in the model's params structure, as the optimizer
      sees them; None: the ``{path: leaf}`` dict.
    stage: the stage it steps: random keys in its state draw that
      stage's own stream (``stage_keys``).
    skip_nonfinite: a step whose ``scale`` is not finite (the driver's
      signal: the global gradient was not) leaves the params and the
      state as they were (``skip_nonfinite_steps``).
    param_dtypes: the dtypes of the stage's param leaves, where they
      may differ from ``grad_layout``'s (gradients summed wider,
      ``grad_accum_dtype``): its gradient buffers are then not donated
      (they could not hold the new params). None: the same.
  """

  def __init__(
    self,
    names: Sequence[str],
    tx: optax.GradientTransformation,
    *,
    positions: Sequence[int] | None = None,
    gap_aware: dict | None = None,
    predictor: staleness.Predictor | None = None,
    learning_rate_schedule=None,
    horizon: int = 0,
    grad_layout: FlatLayout | None = None,
    compiler_options: dict[str, Any] | None = None,
    state_own_bytes: float | None = None,
    view: ParamsView | None = None,
    stage: int = 0,
    param_dtypes: Sequence[Any] | None = None,
    skip_nonfinite: bool = False,
  ):
    self.names = tuple(names)
    self.skip_nonfinite = skip_nonfinite
    self.view = view if view is not None else KeyedLeaves(self.names)
    self.state_own_bytes = state_own_bytes
    options = compiler_options or None
    if positions is None:
      positions = range(len(self.names))
    self.positions = tuple(positions)
    self.base_tx = tx
    self.gap_aware = gap_aware is not None
    # Its step takes the delay where a GA step takes the stale params.
    self.gap_from_grad = bool(gap_aware and gap_aware.get("gap_from_grad"))
    self.tx = staleness.gap_aware(tx, **gap_aware) if self.gap_aware else tx
    # Keys in the state draw a stream of the stage's own (``stage_keys``).
    self._tx_update = stage_keyed(self.tx.update, stage)
    self._predictor = predictor
    self._schedule = learning_rate_schedule
    self._horizon = horizon
    self.init = jax.jit(
      lambda leaves: self.stored(self.view.keyed(self._init(leaves))),
      compiler_options=options,
    )
    self.update = jax.jit(self.apply, compiler_options=options)
    self.predict = jax.jit(self._predict, compiler_options=options)
    self.predict_packed = None
    self._grad_layout = grad_layout
    self._options = options
    self._packed_updates = {}  # (added, replicas, donate_state) -> program
    # The gradient's own buffers become the new params' where both have
    # one dtype (not where gradients are summed wider: grad_accum_dtype).
    self._donate_grads = param_dtypes is None or (
      grad_layout is not None
      and tuple(grad_layout.leaf_dtypes) == tuple(map(jnp.dtype, param_dtypes))
    )
    if grad_layout is not None:
      unpack = grad_layout.unpack
      self.predict_packed = jax.jit(
        lambda params, opt_state, delay, flat: self._predict(
          params, opt_state, delay, unpack(flat)
        ),
        compiler_options=options,
      )

  def _init(self, leaves):
    """``tx.init``'s state, in the dtypes one step leaves it in: with
    gradients summed wider than the params (``grad_accum_dtype``), optax
    state that follows the gradient (``promoted_state``) becomes that
    dtype at the first step on one device, and a stored state keeps one
    layout."""
    params = self.as_dict(leaves)
    state = self.tx.init(params)
    layout = self._grad_layout
    if layout is None or all(
      d == x.dtype for d, x in zip(layout.leaf_dtypes, leaves, strict=True)
    ):
      return state
    grads = self.as_dict(
      [
        jax.ShapeDtypeStruct(x.shape, d)
        for x, d in zip(leaves, layout.leaf_dtypes, strict=True)
      ]
    )
    extra = {}
    if self.gap_from_grad:
      extra = {"delay": jax.ShapeDtypeStruct((), jnp.int32)}
    elif self.gap_aware:
      extra = {"stale_params": params}
    return promoted_state(self._tx_update, state, params, grads, extra)

  def as_dict(self, leaves: Sequence[Any]):
    """The managed leaves of a stage tuple as the optimizer sees them:
    in the model's structure (``view``), else keyed by path."""
    return self.view.view([leaves[i] for i in self.positions])

  def as_tuple(self, tree, like: Sequence[Any]) -> tuple:
    """``like`` with the managed leaves replaced from ``tree`` (as
    ``as_dict`` makes it)."""
    out = list(like)
    for i, x in zip(self.positions, self.view.leaves(tree), strict=True):
      out[i] = x
    return tuple(out)

  def _structured(self, state, params):
    """A stored state (unpacked) as the optimizer keeps it; ``params``
    (as ``as_dict`` makes them) to find its params-shaped parts if no
    state was seen yet."""
    if self.view.keyed_paths is None:
      self.view.keyed(jax.eval_shape(self.tx.init, params))
    return self.view.structured(state)

  def stored(self, tree):
    """An optimizer state (optax's tree, as ``tx.init`` makes it) as this
    stage stores it: packed with ``state_own_bytes`` (traceable)."""
    if self.state_own_bytes is None:
      return tree
    return PackedTree.pack(tree, self.state_own_bytes)

  @staticmethod
  def stored_like(stored, tree):
    """``tree`` (optax's, shaped as ``stored``'s) stored as ``stored`` is:
    in its layout where packed (traceable; host arrays are packed on the
    default device)."""
    if isinstance(stored, PackedTree):
      return stored.repack(tree)
    return tree

  @staticmethod
  def state_tree(opt_state):
    """A stored optimizer state as optax's tree (traceable; a host copy,
    ``jax.device_get``'s, is read on the host)."""
    if isinstance(opt_state, PackedTree):
      return opt_state.unpack()
    return opt_state

  def base_state(self, opt_state):
    """The optimizer's own state (inside Gap-Aware's on a GA stage), as
    optax's tree, from a stored state."""
    opt_state = self.state_tree(opt_state)
    return opt_state.inner_state if self.gap_aware else opt_state

  def apply(
    self, grads, opt_state, params, stale_params, scale=1.0, update_scale=1.0
  ):
    """The step as a traceable function (``update`` is it jitted; a stage
    program may end with it, ``StagePrograms.with_step``): new
    (params, opt_state) from ``scale * grads``, the update times
    ``update_scale``; ``stale_params`` only on a GA stage (its delay, an
    int32 scalar, with ``gap_from_grad``). ``scale``
    (traced) turns a window's gradient sum into its mean where the window
    ended short (a flush); ``update_scale`` is FTPipe's learning rate
    times r / step_every there instead. ``params`` (and ``stale_params``)
    stored packed or as leaves; the new params are stored as ``params``
    are."""
    stored_params, params = params, leaves_of(params)
    g, p = self.as_dict(grads), self.as_dict(params)
    g = jax.tree.map(lambda x: x * jnp.asarray(scale, x.dtype), g)
    stored = opt_state
    state = self._structured(self.state_tree(opt_state), p)
    if self.skip_nonfinite:  # (The update's math on zeros, then dropped.)
      ok = jnp.isfinite(scale)
      g = jax.tree.map(lambda x: jnp.where(ok, x, jnp.zeros_like(x)), g)
      before = (p, state)
    if self.gap_from_grad:
      updates, state = self._tx_update(g, state, p, delay=stale_params)
    elif self.gap_aware:
      stale = self.as_dict(leaves_of(stale_params))
      updates, state = self._tx_update(g, state, p, stale_params=stale)
    else:
      updates, state = self._tx_update(g, state, p)
    updates = jax.tree.map(
      lambda u: u * jnp.asarray(update_scale, u.dtype), updates
    )
    new = optax.apply_updates(p, updates)
    if self.skip_nonfinite:  # Params and state as they were.
      new, state = jax.tree.map(
        lambda b, a: jnp.where(ok, a, b), before, (new, state)
      )
    # The same per-leaf math; where leaves share a buffer XLA fuses the
    # update differently (its floating-point contraction), so a packed
    # moment can differ from a tree-stored one in the last bits (not with
    # ``state_own_bytes=0``: nothing shares a buffer).
    new_params = stored_params_like(stored_params, self.as_tuple(new, params))
    return new_params, self.stored_like(stored, self.view.keyed(state))

  def apply_tied(
    self,
    grads,
    added: Sequence[int],
    added_grads,
    replicas: Sequence[int],
    opt_state,
    params,
    stale_params,
    scale=1.0,
    update_scale=1.0,
  ):
    """``apply`` for a stage holding tied leaves, traceable:
    ``added_grads[i]`` (a holder's gradient of a leaf this stage owns) is
    added to the gradient at position ``added[i]`` first. Returns ``(new
    params, new opt_state, the gradients at positions replicas)`` (the
    leaves another stage owns and steps)."""
    grads = list(grads)
    for p, g in zip(added, added_grads, strict=True):
      grads[p] = grads[p] + g
    out = tuple(grads[p] for p in replicas)
    new_params, new_state = self.apply(
      tuple(grads), opt_state, params, stale_params, scale, update_scale
    )
    return new_params, new_state, out

  def _predict(self, params, opt_state, delay, grad):
    """The params ``delay`` steps ahead (delay traced: one compile),
    stored as ``params`` are."""
    stored_params, params = params, leaves_of(params)
    view = self.as_dict(params)
    state = self._structured(self.state_tree(opt_state), view)
    state = state.inner_state if self.gap_aware else state
    learning_rates = None
    if self._schedule is not None:
      count = staleness.step_count(state)
      learning_rates = staleness.schedule_lookahead(
        self._schedule, count, self._horizon
      )
    predicted = self._predictor(
      view,
      state,
      delay,
      grad=None if grad is None else self.as_dict(grad),
      learning_rates=learning_rates,
    )
    return stored_params_like(stored_params, self.as_tuple(predicted, params))
