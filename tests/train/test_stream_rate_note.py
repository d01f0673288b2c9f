"""The training CLI notes, before training, that an asynchronous stream
without ``step_every`` steps per microbatch (a 1F1B learning rate may be
too high for it), and not where it steps per batch."""

import jax
import optax
import pytest

import jpipe
from jpipe.train.pipeline_mode import print_plan
from tests.partition import flax_models


@pytest.mark.parametrize(
  "schedule, step_every, noted",
  [("async", 1, True), ("async", 4, False), ("1f1b", 1, False)],
)
def test_a_stream_stepping_per_microbatch_is_noted(
  schedule, step_every, noted, capsys
):
  loss_fn, params, batch, _ = flax_models.mlp_case()
  print_plan(
    jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=2,
      devices=jax.devices()[:2],
      num_microbatches=4,
      optimizer=optax.sgd(0.1),
      schedule=schedule,
      step_every=step_every,
    )
  )
  notes = [
    line
    for line in capsys.readouterr().out.splitlines()
    if line.startswith("Note: async steps each stage")
  ]
  assert len(notes) == int(noted)
  if noted:
    assert "--config.schedule.step_every=4" in notes[0]
