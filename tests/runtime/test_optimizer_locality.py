"""A pipeline steps each stage on its own leaves: an optimizer whose step
reads leaves of several stages (``optax.clip_by_global_norm`` in a chain,
``apply_if_finite``, step sizes estimated over the whole model) is refused
before anything compiles, naming the fix; the per-leaf ones run
(``runtime/build/optimizer_locality.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib

import jpipe
from jpipe.runtime.build.optimizer_locality import (
  check_stage_local,
  output_dependencies,
)
from jpipe.runtime.build.stage_optimizer import leaf_names
from tests.partition import flax_models


def _inputs(deps: int) -> set[int]:
  return {i for i in range(deps.bit_length()) if deps >> i & 1}


@jax.custom_vjp
def _clip_gradient(x):
  return x


_clip_gradient.defvjp(
  lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),)
)


def _program(a, b, c, d):
  """Outputs whose inputs are stated by hand in ``test_dependencies``."""
  return (
    jax.jit(lambda u, v: u * 2)(a, b),  # v unused inside the jit
    jax.lax.cond(c > 0, lambda u, v: u, lambda u, v: -u, a, b),
    *jax.lax.while_loop(
      lambda s: s[0] < d,
      lambda s: (s[0] + 1, s[1] * 2, s[2] + s[1]),
      (jnp.int32(0), a, b),
    ),
    *jax.lax.scan(lambda carry, x: (carry, x * 2), a, jnp.stack([b, b])),
    *jax.lax.scan(lambda carry, x: (carry + x, carry), a, jnp.stack([b, b])),
    _clip_gradient(b),
    jax.checkpoint(lambda u, v: u + 1)(a, b),
    jax.nn.relu(a),  # custom_jvp
  )


def test_dependencies_through_higher_order_primitives():
  x = jnp.ones(3)
  traced = jax.make_jaxpr(_program)(x, x, jnp.float32(1), jnp.int32(2))
  a, b, c, d = 0, 1, 2, 3
  want = [
    {a},  # jit: its body reads u only
    {c, a},  # cond: the predicate and the branches' reads
    {d},  # while: the counter, read by the predicate with d
    {a, d},  # doubled a, as many times as the predicate says
    {b, a, d},  # b plus the running a
    {a},  # scan: a carry that never reads xs
    {b},  # ... and ys of xs alone
    {a, b},  # scan: carry + x
    {a, b},  # ... ys are earlier carries
    {b},  # custom_vjp
    {a},  # remat
    {a},  # custom_jvp
  ]
  assert [_inputs(d) for d in output_dependencies(traced)] == want


def _tree():
  """Two 'stages' of two layers each: leaves 0-3 on stage 0, 4-7 on 1."""
  k = jax.random.split(jax.random.key(0), 8)
  params = {
    f"l{i}": {
      "b": jax.random.normal(k[2 * i], (4,)),
      "w": jax.random.normal(k[2 * i + 1], (4, 4)),
    }
    for i in range(4)
  }
  stages = [frozenset({i // 4}) for i in range(8)]
  names = [f"{m}/{n}" for m in sorted(params) for n in ("b", "w")]
  return params, stages, names


_PER_LEAF = {
  "adamw": lambda: optax.adamw(1e-2),
  "adafactor": lambda: optax.adafactor(1e-2),
  "lamb": lambda: optax.lamb(1e-2),
  "muon": lambda: contrib.muon(1e-2),
  "schedule_free": lambda: contrib.schedule_free_adamw(1e-2),
  "multisteps": lambda: optax.MultiSteps(
    optax.adam(1e-2), 2
  ).gradient_transformation(),
  "inject": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
  "agc": lambda: optax.chain(optax.adaptive_grad_clip(0.1), optax.sgd(0.1)),
  # A global-norm clip over one stage's leaves only: that stage computes it.
  "masked_clip": lambda: optax.chain(
    optax.masked(
      optax.clip_by_global_norm(1.0),
      {f"l{i}": {"b": i < 2, "w": i < 2} for i in range(4)},
    ),
    optax.sgd(0.1),
  ),
}

_COUPLED = {
  "clip_by_global_norm": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.adam(1e-2)
  ),
  "apply_if_finite": lambda: optax.apply_if_finite(optax.sgd(0.1), 3),
  "normalize_by_update_norm": lambda: optax.chain(
    optax.normalize_by_update_norm(), optax.sgd(0.1)
  ),
  "prodigy": lambda: contrib.prodigy(1.0),
  "dadapt": lambda: contrib.dadapt_adamw(1.0),
  "mechanize": lambda: contrib.mechanize(optax.sgd(0.1)),
}


@pytest.mark.parametrize("name", sorted(_PER_LEAF))
def test_per_leaf_optimizers_pass(name):
  params, stages, names = _tree()
  check_stage_local(_PER_LEAF[name](), params, stages, names)


@pytest.mark.parametrize("name", sorted(_COUPLED))
def test_coupled_optimizers_are_refused(name):
  params, stages, names = _tree()
  with pytest.raises(ValueError, match="couples leaves of different stages"):
    check_stage_local(_COUPLED[name](), params, stages, names)
  # On one stage the same optimizer is one device's.
  check_stage_local(_COUPLED[name](), params, [frozenset({0})] * 8, names)


def test_the_message_names_two_leaves_and_the_fix():
  params, stages, names = _tree()
  with pytest.raises(ValueError) as e:
    check_stage_local(_COUPLED["clip_by_global_norm"](), params, stages, names)
  assert "'l0/b' (stage 0)" in str(e.value)
  assert "(stage 1)" in str(e.value)
  assert "clip_global_norm=c" in str(e.value)


def test_a_state_value_over_stages_is_named():
  params, stages, names = _tree()
  with pytest.raises(ValueError, match=r"optimizer state's .*estim_lr"):
    check_stage_local(_COUPLED["dadapt"](), params, stages, names)


def test_tied_and_unused_leaves():
  """A leaf two stages hold (tied) may be read by either's updates; a
  leaf no stage holds is left out."""
  params, stages, names = _tree()
  tx = optax.chain(
    optax.masked(
      optax.clip_by_global_norm(1.0),
      {f"l{i}": {"b": i in (1, 2), "w": False} for i in range(4)},
    ),
    optax.sgd(0.1),
  )
  with pytest.raises(ValueError, match="couples"):
    check_stage_local(tx, params, stages, names)
  # l1/b (leaf 2) held by both stages: the clip of l1/b and l2/b can run
  # on stage 1.
  tied = list(stages)
  tied[2] = frozenset({0, 1})
  check_stage_local(tx, params, tied, names)
  unheld = list(stages)
  unheld[2] = frozenset()
  check_stage_local(tx, params, unheld, names)


@pytest.mark.parametrize(
  "tx",
  [
    contrib.reduce_on_plateau(),
    optax.polyak_sgd(),
  ],
  ids=["reduce_on_plateau", "polyak_sgd"],
)
def test_an_update_needing_the_loss_is_refused(tx):
  params, stages, names = _tree()
  with pytest.raises(ValueError, match="value"):
    check_stage_local(tx, params, stages, names)


@pytest.mark.parametrize(
  "name", ["adamw", "masked_clip", "clip_by_global_norm"]
)
def test_dependencies_are_sound(name):
  """Property: an input an output does not depend on can change without
  changing that output (perturbed one at a time, numerically)."""
  tx = {**_PER_LEAF, **_COUPLED}[name]()
  params, _, _ = _tree()
  grads = jax.tree.map(lambda x: 0.3 * jnp.cos(x), params)
  state = tx.init(params)
  state = tx.update(grads, state, params)[1]  # (A step taken.)

  def update(*flat):
    g, s, p = jax.tree.unflatten(treedef, flat)
    return jax.tree.leaves(tx.update(g, s, p))

  args = (grads, state, params)
  flat, treedef = jax.tree.flatten(args)
  deps = output_dependencies(jax.make_jaxpr(update)(*flat))
  base = update(*flat)
  rng = np.random.default_rng(0)
  for i, x in enumerate(flat):
    moved = list(flat)
    moved[i] = x + jnp.asarray(rng.normal(size=np.shape(x)) + 0.5, x.dtype)
    for o, (before, after) in enumerate(zip(base, update(*moved), strict=True)):
      if not deps[o] >> i & 1:
        np.testing.assert_array_equal(before, after, err_msg=f"{o} on {i}")


def _pipeline(tx):
  """(the 2-stage 1F1B pipeline of the MLP case with ``tx``, its params,
  its batch)."""
  loss_fn, params, batch, _ = flax_models.mlp_case()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    num_microbatches=2,
    optimizer=tx,
  )
  return pipe, params, batch


def test_a_pipeline_refuses_a_global_norm_clip_in_its_optimizer():
  tx = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(0.1))
  with pytest.raises(jpipe.OptimizerError, match="clip_global_norm=c"):
    _pipeline(tx)


def test_each_stage_draws_noise_of_its_own_from_the_one_key():
  """``add_noise``: leaves at the same position on two stages (equal
  Dense layers) get independent noise, each stage's drawn as optax draws
  it for its own leaves (stage 0: from the key; stage s: from the key
  folded with s), and the key kept is one device's after a step."""
  key = jax.random.key(7)
  tx = optax.chain(optax.add_noise(1.0, 0.0, key), optax.sgd(1.0))
  pipe, params, batch = _pipeline(tx)
  state, _ = pipe.step(pipe.init(params), batch)
  loss_fn = flax_models.mlp_case()[0]
  grads = jax.grad(loss_fn)(params, batch)
  # sgd(1): new = old - (grad + noise).
  noise = jax.tree.map(
    lambda p, n, g: p - n - g, params, pipe.gather_params(state), grads
  )
  flat = dict(zip(leaf_names(params), jax.tree.leaves(noise), strict=True))
  per_stage = []
  for s, spec in enumerate(pipe.stages.specs):
    names = [pipe.leaf_names[i] for i in spec.param_leaves]
    got = {n: flat[n] for n in names}
    stage_key = key if s == 0 else jax.random.fold_in(key, s)
    sample = jax.random.split(stage_key)[1]
    want = optax.tree.random_like(sample, got, jax.random.normal)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), got, want
    )
    per_stage.append(list(got.values()))
  same_shape = [
    (a, b)
    for a, b in zip(*per_stage, strict=False)  # Same positions, stages 0 and 1.
    if a.shape == b.shape
  ]
  assert same_shape and all(not np.allclose(a, b) for a, b in same_shape)
  saved = pipe.state_dict(state)["opt_state"][0].rng_key
  np.testing.assert_array_equal(
    saved, jax.random.key_data(jax.random.split(key)[0])
  )


def test_a_key_in_the_optimizer_state_trains_and_round_trips():
  """``optax.add_noise`` keeps a typed PRNG key: stored apart from the
  packed state, written to a state dict as its key data, read back a key
  (the next steps equal the unbroken run's)."""
  pipe, params, batch = _pipeline(
    optax.chain(optax.add_noise(0.1, 0.55, 0), optax.sgd(0.1))
  )
  state, _ = pipe.step(pipe.init(params), batch)
  saved = pipe.state_dict(state)
  noise = saved["opt_state"][0]
  assert noise.rng_key.dtype == np.uint32
  assert isinstance(noise.rng_key, np.ndarray)
  resumed = pipe.load_state_dict(saved)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
    resumed, _ = pipe.step(resumed, batch)
  jax.tree.map(
    np.testing.assert_array_equal,
    pipe.gather_params(state),
    pipe.gather_params(resumed),
  )
  assert jax.tree.structure(pipe.gather_params(state)) == jax.tree.structure(
    params
  )
