"""The training CLI says, before training, when one node is over the even
share of the stages (``Plan.indivisible_note``)."""

import jax
import optax

import jpipe
from jpipe.train.pipeline_mode import print_plan
from tests.partition import scan_models


def _pipe(shared):
  loss_fn, params, batch = scan_models.linen_case(shared=shared)
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=4,
    devices=jax.devices()[:4],
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
  )


def test_the_plan_printed_names_an_indivisible_node(capsys):
  print_plan(_pipe(shared=True))  # The blocks share params: one node.
  lines = capsys.readouterr().out.splitlines()
  warned = [line for line in lines if line.startswith("Warning: node")]
  assert len(warned) == 1 and "'blocks'" in warned[0]
  assert "the even share of 4 stages" in warned[0]
  print_plan(_pipe(shared=False))  # Stacked: one node per layer, balanced.
  assert "Warning" not in capsys.readouterr().out
