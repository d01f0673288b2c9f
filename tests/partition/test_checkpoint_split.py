"""A ``jax.checkpoint`` whose work spans nodes, split into one per node
(``_checkpoint_split``): the split jaxpr computes the original's values
and gradients (``jax.core.eval_jaxpr`` of both); it has the nodes the same
model without remat has, each piece with the checkpoint's policy, saving
only what crosses between pieces; a checkpoint within one node stays as
it is; whole-loss, whole-model and per-block remat train through stages
as one device."""

import contextlib
import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

import jpipe
from jpipe import partition
from jpipe.partition._checkpoint_split import REMAT
from tests.runtime.test_replicated_stages import _trains_like_one_device

SAVE_FC1 = jax.checkpoint_policies.save_only_these_names("fc1_out")


class Block(nn.Module):
  """A residual MLP block, its first layer's output named."""

  @nn.compact
  def __call__(self, x):
    h = checkpoint_name(nn.Dense(16, name="fc1")(x), "fc1_out")
    return x + nn.Dense(16, name="fc2")(jnp.tanh(h))


class Net(nn.Module):
  """``blocks`` blocks (each ``block``: Block or a rematted Block) and a
  head. Input [B, 16] -> logits [B, 4]."""

  block: type = Block
  blocks: int = 3

  @nn.compact
  def __call__(self, x):
    for i in range(self.blocks):
      x = self.block(name=f"block_{i}")(x)
    return nn.Dense(4, name="head")(x)


def _batch():
  x = jax.random.normal(jax.random.key(0), (8, 16))
  return {"x": x, "y": jnp.arange(8) % 4}


def _loss(model):
  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn


def _cases():
  """Name -> loss_fn over Net's params: the same function each time,
  rematted differently."""
  plain = _loss(Net())
  return {
    "whole loss": jax.checkpoint(plain, policy=SAVE_FC1),
    "whole model": _loss(nn.remat(Net, policy=SAVE_FC1)()),
    # (Nested: a rematted model of rematted blocks.)
    "model of blocks": _loss(nn.remat(Net)(block=nn.remat(Block))),
    "blocks": _loss(Net(block=nn.remat(Block, policy=SAVE_FC1))),
  }


def _params():
  return Net().init(jax.random.key(1), _batch()["x"])


def _value_and_grad(closed, leaves, num_params):
  def f(*params):
    return jax.core.eval_jaxpr(
      closed.jaxpr, closed.consts, *params, *leaves[num_params:]
    )[0]

  return jax.value_and_grad(f, argnums=tuple(range(num_params)))(
    *leaves[:num_params]
  )


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("case", list(_cases()))
def test_the_split_computes_the_same_with_the_nodes_of_no_remat(case, depth):
  params, batch = _params(), _batch()
  loss_fn = _cases()[case]
  traced = partition.trace(loss_fn, params, batch)
  cut = traced.at_depth(depth)
  plain = partition.trace(_loss(Net()), params, batch).at_depth(depth)
  assert cut.node_names == plain.node_names
  assert traced.max_depth == plain.max_depth == 2
  leaves = jax.tree.leaves((params, batch))
  n = len(jax.tree.leaves(params))
  want = _value_and_grad(traced.whole.closed_jaxpr, leaves, n)
  got = _value_and_grad(cut.closed_jaxpr, leaves, n)
  np.testing.assert_allclose(got[0], loss_fn(params, batch), rtol=1e-6)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  for g, w in zip(got[1], want[1], strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
  # Every piece is one node's work and keeps its checkpoint's policy.
  policies = {
    e.params["policy"]
    for e in traced.whole.closed_jaxpr.jaxpr.eqns
    if e.primitive.name in REMAT
  }
  for i, e in enumerate(cut.jaxpr.eqns):
    if e.primitive.name in REMAT:
      assert e.params["policy"] in policies | {None}
      assert e.params["prevent_cse"]
      assert cut.eqn_scopes[i][:depth] == tuple(
        cut.node_names[cut.eqn_node[i]].split("#")[0].split("/")
      )


def test_a_checkpoint_within_one_node_stays_as_it_is():
  """Per-block remat cut at blocks: the very trace, checkpoints whole."""
  traced = partition.trace(_cases()["blocks"], _params(), _batch())
  assert traced.depth == 1
  assert traced.closed_jaxpr is traced.whole.closed_jaxpr
  remats = [e for e in traced.jaxpr.eqns if e.primitive.name in REMAT]
  assert len(remats) == 3  # One per block.


def test_the_pieces_save_only_what_crosses_between_them():
  """Nothing-saveable remat of the whole loss, split per block: backward
  keeps the inputs and each piece's outputs, not what is inside a piece
  (fc1's and tanh's results), while the loss without remat keeps those."""
  params, batch = _params(), _batch()
  nothing = jax.checkpoint_policies.nothing_saveable
  plain = _loss(Net())
  traced = partition.trace(jax.checkpoint(plain, policy=nothing), params, batch)
  closed = traced.closed_jaxpr
  leaves = jax.tree.leaves((params, batch))
  n = len(jax.tree.leaves(params))

  def saved(fn):  # (One line per residual backward keeps.)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      jax.ad_checkpoint.print_saved_residuals(fn, *leaves[:n])
    lines = out.getvalue().splitlines()  # (The batch: constants here.)
    return [r for r in lines if "argument" not in r and "constant" not in r]

  def split_loss(*p):
    return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *p, *leaves[n:])[0]

  def plain_loss(*p):
    return plain(jax.tree.unflatten(jax.tree.structure(params), p), batch)

  pieces = [e for e in closed.jaxpr.eqns if e.primitive.name in REMAT]
  assert len(pieces) == 4  # 3 blocks and the head with the loss.
  crossing = sum(len(e.outvars) for e in pieces)
  # (The pieces' outputs: 3 blocks' and the scalar loss.)
  assert 0 < len(saved(split_loss)) <= crossing < len(saved(plain_loss))


@pytest.mark.parametrize(
  "case, stages", [("whole loss", 3), ("whole model", 2), ("blocks", 2)]
)
def test_remat_across_stages_trains_as_one_device(case, stages):
  """Three stages of a whole-loss checkpoint: one per block and the head;
  two stages of rematted blocks (the model or each block): a cut inside
  block_1, splitting its checkpoint."""
  params, batch = _params(), _batch()
  loss_fn = _cases()[case]
  tx = optax.adam(1e-2)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=stages,
    devices=jax.devices()[:stages],
    num_microbatches=2,
    schedule="1f1b",
    optimizer=tx,
  )
  # (By FLOPs: two stages balance only with a cut inside block_1.)
  assert pipe.granularity.depth == (1 if stages == 3 else 2)
  count = [
    sum(e.primitive.name in REMAT for e in closed.jaxpr.eqns)
    for closed in (pipe.traced.closed_jaxpr, pipe.traced.whole.closed_jaxpr)
  ]
  assert count[0] > count[1]  # Split, and each piece still rematted.
  _trains_like_one_device(pipe, loss_fn, params, batch, tx, steps=2)
