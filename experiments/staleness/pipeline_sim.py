"""An exact simulation of an asynchronous (PipeDream 1F1B) pipeline.

A model of ordered units is cut into n stages; stage s has delay
d_s = n - 1 - s (FTPipe's stage depth). In steady state, microbatch t runs
its forward on stage s at the params after t - d_s updates, and stage s
applies microbatch t's gradient as its (t+1)-th update. Which params the
forward, the backward and Gap-Aware see depends on the mitigation:

- none (FTPipe "stale", recomputation): forward at theta^(t-d_s), backward
  recomputes at the current theta^(t) on the stale input and received
  gradient.
- ws: the backward runs at the stashed forward-time params.
- wp: the forward runs at predict(theta^(t-d_s), state, d_s) (msnag); the
  backward recomputes at the current params unless ws is on too.
- ga: Gap-Aware on every stage but the last, comparing the current params
  with the forward-time ones (FTPipe's policy ``all_except_last``). With ws
  that is FTPipe's ``ga``; without, the backward ran at the current params,
  which is FTPipe's ``ga_jfl`` gap with a non-stashed backward.
- pm: PipeMare's learning-rate rescheduling (T1): stage s's rate divided by
  d_s ** (1 - min(k / K, 1)) at step k, K = a quarter of the run.
- nag: the delay-aware Nesterov method (Ajanthan et al., ICML 2025), as its
  authors' code runs it: Adam / AdamW become PyTorch's NAdam(W) and SGD
  Nesterov SGD, with each stage's momentum raised with its delay
  (``--adaptive_momentum``: 0.9 + d_s (0.99 - 0.9) / n). ``nag99``: the
  authors' "ours", beta1 = 0.99 on every stage (Adam / AdamW only: SGD's
  rate tuned for momentum 0.9 would be ten times larger at 0.99). Both
  with weight stashing (``ws+nag``), as the authors run them.
- nr (FTPipe's no-recompute mode, with "none" or "wp"): the backward keeps
  the forward's activations (each unit's input and pre-activation) and
  reads the current params: weight gradients from the forward-time
  activations, input gradients at the current weights (PipeDream without
  stashing; ``unit_backward``).

Each step t is computed in order (forward through all stages, backward from
the last), which reproduces the pipeline's values exactly because every
stage's version for microbatch t is fixed by the delays, whatever the wall
clock order of the actions. The forward-time params of the microbatches in
flight live in one jpipe.staleness weight stash per stage (d_s + 1 slots).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jpipe import staleness

METHODS = (
  "none",
  "ws",
  "wp",
  "ga",
  "wp+ga",
  "ws+ga",
  "nr",
  "wp+nr",
  "pm",
  "ws+pm",
  "ws+nag",
  "ws+nag99",
  "ws+nag+pm",
)
# PipeMare's annealing: a quarter of the run (AsyncPP anneals over 7 of 50
# epochs; a short run needs the rate back sooner).
PIPEMARE_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """An optimizer of the study: name in sgd/adam/adamw and its numbers."""

  name: str
  learning_rate: float
  momentum: float = 0.9
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999

  def base(self) -> optax.GradientTransformation:
    if self.name == "sgd":
      sgd = optax.sgd(self.learning_rate, momentum=self.momentum)
      if self.weight_decay:
        return optax.chain(optax.add_decayed_weights(self.weight_decay), sgd)
      return sgd
    if self.name == "adam":
      return optax.adam(self.learning_rate, b1=self.b1, b2=self.b2)
    return optax.adamw(
      self.learning_rate, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay
    )

  def with_gap_aware(self) -> optax.GradientTransformationExtraArgs:
    beta = 0.999 if self.name == "sgd" else self.b2  # FTPipe's choices.
    return staleness.gap_aware(
      self.base(),
      optimizer=self.name,
      beta=beta,
      learning_rate=self.learning_rate,
      weight_decay=self.weight_decay,
    )

  def delay_aware_nesterov(
    self, delay: int, num_stages: int, fixed: bool
  ) -> optax.GradientTransformation:
    """The stage optimizer of the delay-aware Nesterov method."""
    if fixed and self.name == "sgd":
      raise ValueError("nag99 is for adam / adamw (see the module doc)")
    return staleness.delay_aware_nesterov(
      self.learning_rate,
      delay=delay,
      num_stages=num_stages,
      optimizer=self.name,
      momentum=staleness.NESTEROV_MOMENTUM
      if fixed
      else (self.momentum if self.name == "sgd" else self.b1),
      adaptive=not fixed,
      b2=self.b2,
      weight_decay=self.weight_decay,
    )

  def predictor(self) -> staleness.Predictor:
    return staleness.weight_predictor(
      self.name,
      learning_rate=self.learning_rate,
      momentum=self.momentum,
      b1=self.b1,
      b2=self.b2,
      weight_decay=self.weight_decay,
    )


def init_units(
  key: jax.Array, num_units: int, in_dim: int, width: int, num_classes: int
) -> list[dict]:
  """Residual MLP units: an input projection, blocks, a classifier head."""
  keys = jax.random.split(key, num_units)

  def dense(k, n_in, n_out, scale):
    w = jax.random.normal(k, (n_in, n_out)) * scale / np.sqrt(n_in)
    return {"w": w, "b": jnp.zeros((n_out,))}

  units = [dense(keys[0], in_dim, width, np.sqrt(2.0))]
  units += [dense(k, width, width, 0.5) for k in keys[1:-1]]
  units.append(dense(keys[-1], width, num_classes, 1.0))
  return units


def apply_unit(
  index: int, num_units: int, params: dict, x: jax.Array
) -> jax.Array:
  """Unit `index`: [B, in] -> [B, out]."""
  y = x @ params["w"] + params["b"][None, :]
  if index == 0:
    return jax.nn.relu(y)
  if index == num_units - 1:
    return y
  return x + jax.nn.relu(y)


def unit_forward_saving(index, num_units, params, x):
  """Unit ``index``'s output and what its no-recompute backward keeps:
  (out, (x, y)) with y = x W + b, the pre-activation."""
  y = x @ params["w"] + params["b"][None, :]
  if index == 0:
    return jax.nn.relu(y), (x, y)
  if index == num_units - 1:
    return y, (x, y)
  return x + jax.nn.relu(y), (x, y)


def unit_backward(index, num_units, params, saved, cot):
  """(grads, input cotangent) of unit ``index`` from its saved forward
  values (x, y) and the params it reads now: dW = x^T delta, db = sum
  delta, dx = delta W^T (+ cot through the residual)."""
  x, y = saved
  delta = cot if index == num_units - 1 else cot * (y > 0)
  grads = {"w": x.T @ delta, "b": delta.sum(0)}
  dx = delta @ params["w"].T
  if 0 < index < num_units - 1:
    dx = dx + cot
  return grads, dx


def split_units(num_units: int, num_stages: int) -> list[range]:
  """Contiguous, nearly equal groups of units, earlier stages larger."""
  if not 1 <= num_stages <= num_units:
    raise ValueError(f"need 1 <= num_stages <= {num_units}, got {num_stages}")
  sizes = [
    num_units // num_stages + (s < num_units % num_stages)
    for s in range(num_stages)
  ]
  bounds = np.cumsum([0, *sizes])
  return [
    range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
  ]


def applies(opt_name: str, method: str) -> bool:
  """Whether ``method`` is defined for optimizer ``opt_name`` (nag99 is
  not for SGD)."""
  return not (opt_name == "sgd" and "nag99" in method.split("+"))


def stage_optimizer(opt, method, delay, num_stages, num_steps):
  """Stage optimizer of a stage of delay ``delay`` under ``method``."""
  parts = method.split("+")
  if "nag" in parts or "nag99" in parts:
    tx = opt.delay_aware_nesterov(delay, num_stages, fixed="nag99" in parts)
  elif "ga" in parts:
    tx = opt.with_gap_aware()
  else:
    tx = opt.base()
  if "pm" in parts:
    anneal = max(1, round(PIPEMARE_FRACTION * num_steps))
    tx = optax.chain(tx, staleness.pipemare_learning_rate(delay, anneal))
  return tx


def make_train(
  units_per_stage: list[range],
  num_units: int,
  opt: OptimizerSpec,
  method: str,
  num_steps: int,
  eval_every: int,
):
  """A jit-able ``train(stage_params, data) -> metrics`` for one run.

  ``data``: train_x [N, D], train_y [N], order [num_steps, B] (indices),
  test_x [M, D], test_y [M]. Returns train_loss [num_steps] (the loss each
  microbatch's forward saw) and test_accuracy [num_steps // eval_every].
  """
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}: one of {METHODS}")
  num_stages = len(units_per_stage)
  delays = [num_stages - 1 - s for s in range(num_stages)]
  stash_backward = "ws" in method
  predict_forward = "wp" in method
  no_recompute = "nr" in method
  use_gap_aware = "ga" in method.split("+")
  txs = [stage_optimizer(opt, method, d, num_stages, num_steps) for d in delays]
  predict = opt.predictor()

  def stage_fn(s):
    def fn(params, x):
      for p, u in zip(params, units_per_stage[s], strict=True):
        x = apply_unit(u, num_units, p, x)
      return x

    return fn

  stage_fns = [stage_fn(s) for s in range(num_stages)]

  def full_model(stage_params, x):
    for s in range(num_stages):
      x = stage_fns[s](stage_params[s], x)
    return x

  def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()

  def step(carry, inputs):
    params, states, stashes = carry
    t, x, y = inputs
    forward = [staleness.stash_get(stashes[s], t) for s in range(num_stages)]
    stage_inputs, kept = [], []
    for s in range(num_stages - 1):
      stage_inputs.append(x)
      if no_recompute:
        saved = []
        for p, u in zip(forward[s], units_per_stage[s], strict=True):
          x, unit_saved = unit_forward_saving(u, num_units, p, x)
          saved.append(unit_saved)
        kept.append(saved)
      else:
        x = stage_fns[s](forward[s], x)
    last = num_stages - 1
    loss, (g_last, cot) = jax.value_and_grad(
      lambda p, h: loss_fn(stage_fns[last](p, h), y), argnums=(0, 1)
    )(forward[last], x)
    grads = [None] * num_stages
    grads[last] = g_last
    for s in reversed(range(num_stages - 1)):
      if no_recompute:  # The forward's activations, the current params.
        stage_grads = []
        units = list(zip(params[s], units_per_stage[s], kept[s], strict=True))
        for p, u, saved in reversed(units):
          g, cot = unit_backward(u, num_units, p, saved, cot)
          stage_grads.append(g)
        grads[s] = stage_grads[::-1]
        continue
      at = forward[s] if stash_backward else params[s]
      _, vjp = jax.vjp(stage_fns[s], at, stage_inputs[s])
      grads[s], cot = vjp(cot)
    new_params, new_states, new_stashes = [], [], []
    for s in range(num_stages):
      extra = {"stale_params": forward[s]} if use_gap_aware else {}
      updates, state = txs[s].update(grads[s], states[s], params[s], **extra)
      p = optax.apply_updates(params[s], updates)
      upcoming = p
      if predict_forward and delays[s] > 0:
        upcoming = predict(p, state, delays[s])
      new_params.append(p)
      new_states.append(state)
      new_stashes.append(
        staleness.stash_put(stashes[s], t + 1 + delays[s], upcoming)
      )
    return (new_params, new_states, new_stashes), loss

  def train(stage_params, data):
    carry = (
      list(stage_params),
      [tx.init(p) for tx, p in zip(txs, stage_params, strict=True)],
      [
        staleness.stash_init(p, d + 1)
        for p, d in zip(stage_params, delays, strict=True)
      ],
    )

    def chunk(carry, chunk_steps):
      xs = (
        chunk_steps,
        data["train_x"][data["order"][chunk_steps]],
        data["train_y"][data["order"][chunk_steps]],
      )
      carry, losses = jax.lax.scan(step, carry, xs)
      logits = full_model(carry[0], data["test_x"])
      accuracy = jnp.mean(jnp.argmax(logits, -1) == data["test_y"])
      return carry, (losses, accuracy)

    steps = jnp.arange(num_steps).reshape(-1, eval_every)
    _, (losses, accuracy) = jax.lax.scan(chunk, carry, steps)
    return {"train_loss": losses.reshape(-1), "test_accuracy": accuracy}

  return train
