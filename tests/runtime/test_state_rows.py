"""Model state stacked per layer of a scan split by layer, held as rows
(``runtime/build/state_rows.py``): Flax's NNX scan-over-layers example
(BatchNorm and Dropout in blocks made by ``nnx.vmap``, run by
``nnx.scan``) and a linen ``nn.scan`` with stacked ``batch_stats`` train
through stages as their own microbatch loops; each row is updated on its
layer's stage; what comes out (``gather_model_state``, ``state_dict``)
has the model's stacked layout and resumes under another split;
evaluation reads the rows."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jpipe
from jpipe import dynamic, partition
from tests import tiers
from tests.partition import scan_models
from tests.runtime.test_nnx_loss import (
  LR,
  M,
  _assert_state_close,
  _batch,
  _loss,
  _nnx_loop,
  _pipeline,
)
from tests.runtime.test_pipeline_sync import _assert_tree_close


class Block(nnx.Module):
  """The NNX example's block (``06_scan_over_layers.py``)."""

  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(dim, dim, rngs=rngs)
    self.bn = nnx.BatchNorm(dim, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class ScanMLP(nnx.Module):
  """The example's model (blocks made by ``nnx.vmap`` with split
  streams, run by ``nnx.scan``) between a stem and a head: [B, 6] ->
  logits [B, 3]."""

  def __init__(self, dim: int = 8, *, n_layers: int = 4, rngs: nnx.Rngs):
    self.stem = nnx.Linear(6, dim, rngs=rngs)

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(axis_size=n_layers)
    def create_block(rngs: nnx.Rngs):
      return Block(dim, rngs=rngs)

    self.layers = create_block(rngs)
    self.head = nnx.Linear(dim, 3, rngs=rngs)

  def __call__(self, x):
    @nnx.scan
    def scan_fn(x, block):
      return block(x), None

    x, _ = scan_fn(self.stem(x), self.layers)
    return self.head(x)


def _row_stages(pipe) -> list[tuple[int, int]]:
  """Per row of a stacked state leaf, ``(the stage updating it, the
  stage of its layer's node)``."""
  producer = {
    r: s for s, spec in enumerate(pipe.stages.specs) for r in spec.results
  }
  names = pipe.traced.node_names
  out = []
  for i, (_, row) in enumerate(pipe.state_rows.layout.source):
    if row >= 0:
      layer = pipe.stages.stage_of_node[names.index(f"layers[{row}]")]
      out.append((producer[i + 1], layer))
  return out


@pytest.mark.parametrize("stages, schedule", [(2, "1f1b"), (3, "zbh1")])
def test_nnx_scan_over_layers_trains_as_nnx_own_loop(stages, schedule):
  model = ScanMLP(rngs=nnx.Rngs(0, dropout=1))
  batch = _batch()
  nl = jpipe.nnx_loss(model, _loss)
  pipe = _pipeline(nl, batch, stages, schedule)
  assert pipe.state_rows is not None
  rows = _row_stages(pipe)
  assert rows and all(got == want for got, want in rows)
  assert len({s for s, _ in rows}) > 1  # Rows on several stages.
  state, metrics = pipe.step(pipe.init(nl.params, nl.model_state), batch)
  params, other, losses = _nnx_loop(model, _loss, batch)
  _assert_tree_close(pipe.gather_params(state), params)
  gathered = pipe.gather_model_state(state)
  assert jax.tree.structure(gathered) == jax.tree.structure(nl.model_state)
  _assert_state_close(gathered, other)
  assert float(metrics["loss"]) == pytest.approx(np.mean(losses), rel=1e-5)
  nnx.update(model, pipe.gather_params(state), gathered)
  _assert_tree_close(nnx.state(model, nnx.Param), params)


def _linen_case():
  return scan_models.batch_stats_case(_batch())


def _microbatch_loop(loss_fn, params, model_state, batch, tx, steps):
  """One device: per step, the microbatches' forwards in order (state
  threaded), the mean gradient, an optax step; (params, state)."""
  opt_state, size = tx.init(params), len(batch["y"]) // M
  grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))  # (Traced once.)
  for _ in range(steps):
    grads = None
    for k in range(M):
      mb = jax.tree.map(lambda a, k=k: a[k * size : (k + 1) * size], batch)
      (_, model_state), g = grad_fn(params, model_state, mb)
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    grads = jax.tree.map(lambda g: g / M, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params, model_state


def _linen_pipeline(loss_fn, params, model_state, batch, stages, tx):
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    model_state=model_state,
    num_stages=stages,
    devices=jax.devices()[:stages],
    num_microbatches=M,
    optimizer=tx,
  )


def _two_steps_as_the_loop(case, stages, tx, rows):
  """``(pipeline, state)`` after two steps of ``case`` (loss_fn, params,
  model_state, batch) on ``stages`` stages, checked: ``rows`` state rows,
  each updated on its layer's stage, and params and state equal to the
  microbatch loop's."""
  loss_fn, params, model_state, batch = case
  pipe = _linen_pipeline(loss_fn, params, model_state, batch, stages, tx)
  assert sum(r >= 0 for _, r in pipe.state_rows.layout.source) == rows
  assert all(got == want for got, want in _row_stages(pipe))
  state = pipe.init(params, model_state)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  want = _microbatch_loop(loss_fn, params, model_state, batch, tx, 2)
  _assert_tree_close(pipe.gather_params(state), want[0])
  _assert_state_close(pipe.gather_model_state(state), want[1])
  return pipe, state


def test_linen_stacked_batch_stats_train_as_one_device_and_resume():
  """Two steps on three stages equal the microbatch loop; the state
  dict holds the stacked statistics and resumes on two stages, which
  go on as the loop does."""
  loss_fn, params, model_state, batch = *_linen_case(), _batch()
  tx = optax.adam(1e-2)
  # (Mean, variance and key: each held as its 4 layers' rows.)
  pipe, state = _two_steps_as_the_loop(
    (loss_fn, params, model_state, batch), 3, tx, rows=12
  )
  saved = pipe.state_dict(state)
  stacked = saved["model_state"]["batch_stats"]["layers"]["BatchNorm_0"]
  assert np.shape(stacked["mean"]) == (4, 8)
  other = _linen_pipeline(loss_fn, params, model_state, batch, 2, tx)
  resumed, _ = other.step(other.load_state_dict(saved), batch)
  want = _microbatch_loop(loss_fn, params, model_state, batch, tx, 3)
  _assert_tree_close(other.gather_params(resumed), want[0])
  _assert_state_close(other.gather_model_state(resumed), want[1])


@pytest.mark.parametrize("axes", [tiers.slow((1, 0)), (1, 1)])
def test_layers_stacked_on_axis_1_train_as_one_device(axes):
  """Params stacked on axis 1 (MaxText's layout), the statistics on axis
  0 or 1 too: each stage holds its layers' rows of both, two steps on two
  stages equal the microbatch loop, and the state dict keeps the
  model's layout."""
  batch, tx = _batch(), optax.sgd(0.1)
  loss_fn, params, model_state = scan_models.batch_stats_case(
    batch, noise_key=False, axes=axes
  )
  # (Mean and variance: each held as its 4 layers' rows.)
  pipe, state = _two_steps_as_the_loop(
    (loss_fn, params, model_state, batch), 2, tx, rows=8
  )
  saved = pipe.state_dict(state)["model_state"]["batch_stats"]["layers"]
  layout = (8, 4) if axes[1] == 1 else (4, 8)  # (8 features, 4 layers.)
  assert np.shape(saved["BatchNorm_0"]["mean"]) == layout


def test_evaluation_reads_the_rows():
  """``evaluate`` with a metrics function of the model state (each
  microbatch's sums) equals it on one device."""
  loss_fn, params, model_state, batch = *_linen_case(), _batch()
  tx = optax.sgd(LR)
  pipe = _linen_pipeline(loss_fn, params, model_state, batch, 2, tx)
  state, _ = pipe.step(pipe.init(params, model_state), batch)
  got_params, got_state = (
    pipe.gather_params(state),
    pipe.gather_model_state(state),
  )

  def metrics_fn(params, model_state, batch):
    means = model_state["batch_stats"]["layers"]["BatchNorm_0"]["mean"]
    loss, _ = loss_fn(params, model_state, batch)
    return {"loss": loss, "mean_of_means": jnp.mean(means)}

  got = pipe.evaluate(state, batch, metrics_fn)  # (Summed over them.)
  size = len(batch["y"]) // M
  want = [
    metrics_fn(
      got_params,
      got_state,
      jax.tree.map(lambda a, k=k: a[k * size : (k + 1) * size], batch),
    )
    for k in range(M)
  ]
  for name in ("loss", "mean_of_means"):
    np.testing.assert_allclose(got[name], sum(w[name] for w in want), rtol=1e-5)


def test_a_repartition_moves_the_rows_with_their_layers():
  """DynPipe's move (``PlanSwitch``) to a split putting other layers on
  each stage: training goes on as the microbatch loop."""
  loss_fn, params, model_state, batch = *_linen_case(), _batch()
  tx = optax.sgd(LR, momentum=0.9)

  def build(plan):
    return jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      model_state=model_state,
      num_stages=2,
      devices=jax.devices()[:2],
      partition=plan,
      num_microbatches=M,
      optimizer=tx,
    )

  first = build(partition.Split((3, 4)))
  moved = build(partition.Split((5, 2))).plan
  switch = dynamic.PlanSwitch(build, first)
  state = first.init(params, model_state)
  state, _ = first.step(state, batch)
  state = switch.switch(state, moved)
  layers = [
    switch.pipeline.plan.stage_of_node[
      switch.pipeline.traced.node_names.index(f"layers[{k}]")
    ]
    for k in range(4)
  ]
  assert layers == [0, 0, 0, 1]  # (Was [0, 1, 1, 1].)
  assert all(got == want for got, want in _row_stages(switch.pipeline))
  state, _ = switch.pipeline.step(state, batch)
  want = _microbatch_loop(loss_fn, params, model_state, batch, tx, 2)
  _assert_tree_close(switch.pipeline.gather_params(state), want[0])
  _assert_state_close(switch.pipeline.gather_model_state(state), want[1])
