"""Shared pieces of the staleness transforms: validation and state lookup."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

OPTIMIZERS = ("sgd", "adam", "adamw")

NO_PARAMS_MSG = (
  "This transform needs the current params: call "
  "tx.update(grads, state, params, stale_params=...)."
)

ScalarOrSchedule = float | jax.Array | Callable[[jax.Array], jax.Array]


def is_concrete(x: Any) -> bool:
  """True if `x` is a Python or NumPy number (not a tracer)."""
  return isinstance(x, (int, float, np.number, np.ndarray)) and not isinstance(
    x, bool
  )


def check_optimizer(optimizer: str) -> str:
  """Returns `optimizer` if it is a known name, else raises ValueError."""
  if optimizer not in OPTIMIZERS:
    raise ValueError(
      f"unknown optimizer {optimizer!r}: expected one of {OPTIMIZERS}"
    )
  return optimizer


def check_state_matches(
  opt_state: optax.OptState, optimizer: str, who: str
) -> None:
  """Raises ValueError when ``opt_state`` was not built by ``optimizer``.

  Adam and AdamW keep an ``optax.ScaleByAdamState`` (first and second
  moments), SGD does not: a transform told "sgd" that wraps Adam (or the
  reverse) would read its statistics from the wrong place, silently.
  """
  adam_states = find_states(opt_state, optax.ScaleByAdamState)
  if optimizer == "sgd" and adam_states:
    raise ValueError(
      f"{who}: optimizer='sgd', but the optimizer it runs with is "
      "Adam-like (its state holds an optax.ScaleByAdamState): pass "
      "optimizer='adam' (or 'adamw') to match it"
    )
  if optimizer != "sgd" and not adam_states:
    raise ValueError(
      f"{who}: optimizer={optimizer!r}, but the optimizer it runs with "
      "keeps no Adam moments (no optax.ScaleByAdamState in its state): "
      "pass optimizer='sgd' for SGD, or build it with optax.adam / "
      "optax.adamw"
    )


def check_open_unit(name: str, value: Any) -> None:
  """Raises ValueError unless a concrete `value` lies in (0, 1)."""
  if is_concrete(value) and not 0.0 < float(value) < 1.0:
    raise ValueError(f"{name} must be in (0, 1), got {value}")


def check_unit_interval(name: str, value: Any) -> None:
  """Raises ValueError unless a concrete `value` lies in [0, 1)."""
  if is_concrete(value) and not 0.0 <= float(value) < 1.0:
    raise ValueError(f"{name} must be in [0, 1), got {value}")


def check_non_negative(name: str, value: Any) -> None:
  """Raises ValueError if a concrete `value` is negative."""
  if is_concrete(value) and float(value) < 0.0:
    raise ValueError(f"{name} must be >= 0, got {value}")


_INT32_MAX = 2**31 - 1


def check_delay(delay: Any) -> None:
  """Raises ValueError if a delay is not an integer (a traced one: not of
  an integer dtype), or a concrete one is negative or past int32."""
  bad = f"delay must be an integer >= 0, got {delay!r}"
  if isinstance(delay, bool | str) or delay is None:
    raise ValueError(bad)
  dtype = getattr(delay, "dtype", None)
  if dtype is not None and not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{bad} (of dtype {dtype}: pass an integer one)")
  if isinstance(delay, jax.core.Tracer):
    return  # (Traced: its value is checked nowhere; negative = 0.)
  value = np.asarray(delay)
  if value.ndim or float(value) != int(value) or int(value) < 0:
    raise ValueError(bad)
  if int(value) > _INT32_MAX:
    raise ValueError(f"delay {int(value)} is past int32 ({_INT32_MAX})")


def find_states(opt_state: optax.OptState, state_type: type) -> list[Any]:
  """All sub-states of `opt_state` that are instances of `state_type`."""
  found = jax.tree_util.tree_leaves(
    opt_state, is_leaf=lambda x: isinstance(x, state_type)
  )
  return [x for x in found if isinstance(x, state_type)]


def find_one_state(
  opt_state: optax.OptState, state_type: type, what: str
) -> Any | None:
  """The unique `state_type` inside `opt_state`, or None if there is none.

  Raises ValueError if there are several, since the moments to predict or
  penalise with would then be ambiguous.
  """
  found = find_states(opt_state, state_type)
  if len(found) > 1:
    raise ValueError(
      f"the optimizer state holds {len(found)} {state_type.__name__} "
      f"entries, so the {what} is ambiguous; build the optimizer with a "
      "single one (e.g. optax.sgd(lr, momentum) or optax.adam(lr))"
    )
  return found[0] if found else None


def require_adam_state(opt_state: optax.OptState) -> optax.ScaleByAdamState:
  """The unique ScaleByAdamState in `opt_state` (first and second moments)."""
  state = find_one_state(opt_state, optax.ScaleByAdamState, "Adam moment")
  if state is None:
    raise ValueError(
      "the optimizer state has no optax.ScaleByAdamState (Adam's mu/nu): "
      "build it with optax.adam(...) or optax.adamw(...), or use "
      'optimizer="sgd"'
    )
  return state


def momentum_buffer(
  opt_state: optax.OptState, momentum: Any
) -> optax.Updates | None:
  """SGD's momentum buffer (optax.TraceState.trace), or None without one.

  Raises ValueError if `momentum` is non-zero but the state keeps no trace.
  """
  state = find_one_state(opt_state, optax.TraceState, "momentum buffer")
  if state is None:
    if not is_concrete(momentum) or float(momentum) != 0.0:
      raise ValueError(
        "momentum is non-zero but the optimizer state has no "
        "optax.TraceState: build it with optax.sgd(lr, momentum=...)"
      )
    return None
  return state.trace


# inject_hyperparams' states (optax's two, neither a subclass of the other).
_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def step_count(opt_state: optax.OptState) -> jax.Array:
  """Number of optimizer steps taken, read from the state (int32 scalar)."""
  for state_type in (
    optax.ScaleByAdamState,
    optax.ScaleByScheduleState,
    *_INJECTED,
  ):
    state = find_one_state(opt_state, state_type, "step count")
    if state is not None:
      return state.count
  raise ValueError(
    "cannot read the step count from the optimizer state (no "
    "ScaleByAdamState, ScaleByScheduleState or InjectHyperparamsState): "
    "pass learning_rates= explicitly or use a constant learning rate"
  )


def injected_learning_rate(opt_state: optax.OptState) -> jax.Array | None:
  """The learning rate ``optax.inject_hyperparams`` holds in the state
  (the one the optimizer steps with, however it was changed), or None."""
  state = None
  for state_type in _INJECTED:
    state = state or find_one_state(
      opt_state, state_type, "injected hyperparameters"
    )
  if state is None or "learning_rate" not in state.hyperparams:
    return None
  return jnp.asarray(state.hyperparams["learning_rate"])


def decay_mask_tree(mask: Any, params: Any) -> Any:
  """``mask`` (None: every leaf; a pytree of bools like ``params``; or a
  callable of ``params`` giving one, as ``optax.adamw(mask=...)`` takes)
  as a pytree of Python bools / bool arrays like ``params``."""
  if mask is None:
    return jax.tree.map(lambda _: True, params)
  tree = mask(params) if callable(mask) else mask
  try:
    return jax.tree.map(lambda _, m: m, params, tree)
  except ValueError as e:
    raise ValueError(
      "weight_decay_mask is not shaped like the params (a bool per leaf, "
      f"or a callable of the params giving one): {e}"
    ) from None


def value_at(value: ScalarOrSchedule, count: jax.Array) -> jax.Array:
  """A hyperparameter's value at step `count` (schedules are evaluated)."""
  if callable(value):
    return jnp.asarray(value(count))
  return jnp.asarray(value)


def compute_dtype(dtype: Any) -> Any:
  """The dtype to do prediction arithmetic in: at least float32."""
  return jnp.promote_types(dtype, jnp.float32)
