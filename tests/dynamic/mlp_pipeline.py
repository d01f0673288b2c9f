"""The tests' re-partitioning pipeline: the small MLP in 2 stages on 2
CPU devices, asynchronous with weight stashing, every action sleeping
its share of 50 ms of simulated compute (well above the real work, so a
busy machine cannot blur injected slowdowns)."""

import jax
import optax

import jpipe
from jpipe import dynamic
from tests.partition import flax_models

WINDOW = 2


def build(policy, inject="", horizon_steps=50, predictor=None):
  """``(DynamicPipeline, params, batch)``; ``horizon_steps`` 50: a long
  run ahead, worth a build."""
  loss_fn, params, batch, _ = flax_models.mlp_case()
  build = jpipe.PipelineBuilder.of(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    schedule="async",
    weight_stashing=True,
    num_microbatches=4,
    optimizer=optax.sgd(0.05, momentum=0.9),
  )
  dp = dynamic.DynamicPipeline(
    build,
    policy=policy,
    window=WINDOW,
    horizon_steps=horizon_steps,
    interference=dynamic.Interference(
      dynamic.parse_inject(inject), simulated_seconds=0.05
    ),
    predictor=predictor,
  )
  return dp, params, batch
