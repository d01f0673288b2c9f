"""``Pipeline.generate`` through stages on replica groups: the feeds and
each block's cache split over a group (data-parallel replicas), whole on
its first device (weighted), or on the microbatch's replica (round
robin); the tokens equal a single-device greedy loop's."""

import jax
import numpy as np
import optax
import pytest

import jpipe
from jpipe import partition
from tests.runtime import test_generate
from tests.tiers import slow


def _grouped(model, params, prompts, replicas, routing):
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"], train=False)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], batch["x"][:, 1:]
    ).mean()

  kwargs = {} if routing is None else {"replica_routing": routing}
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    {"x": prompts},
    num_stages=len(replicas),
    num_microbatches=2,
    optimizer=optax.sgd(0.0),
    devices=jax.devices()[: sum(replicas)],
    partition=partition.Split(replicas=replicas),
    **kwargs,
  )
  return pipe, pipe.init(params)


@pytest.mark.parametrize(
  "replicas, routing",
  [
    ((2, 1), None),
    # (One stage: GPT-2's tied embedding on two stages is refused with
    # round-robin and weighted routing.)
    slow((2,), "round_robin", id="round_robin"),
    slow((2,), "weighted", id="weighted"),
  ],
)
def test_generate_on_replica_groups_equals_recomputing_greedy(
  replicas, routing
):
  model, params, prompts = test_generate._tiny()
  pipe, state = _grouped(model, params, prompts, replicas, routing)
  assert [len(p.devices) for p in pipe.placement] == list(replicas)
  got = np.asarray(test_generate._generate(pipe, state, model, prompts, 6))
  want = test_generate._greedy_recomputing(model, params, prompts, 6)
  np.testing.assert_array_equal(got, want)
  assert len({tuple(row) for row in got}) > 1
