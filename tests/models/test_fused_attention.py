"""jpipe's GPT, GPT-2, BERT and T5 models compute attention through
``jax.nn.dot_product_attention`` (cuDNN's fused kernel on NVIDIA GPUs):
on CPU their logits equal the explicit softmax path's (the models' own
code until now, kept as ``fused_attention=False``) within 1e-5, padding
masks and causal masks included; with dropout active both take the
explicit path (a fused kernel forms no weights to drop). The HF
reference tests (test_gpt2, test_bert, test_t5_v1) check the fused
default against HuggingFace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpipe.models import attention, bert, gpt, gpt2, t5, t5_v1

TOKENS = jax.random.randint(jax.random.key(0), (2, 12), 1, 50)
# Padding at the end of the second row (masked out of attention).
PADDED = TOKENS.at[1, 8:].set(0)

CASES = {
  "gpt": (lambda f: gpt.Model(50, 24, 2, 3, 16, fused_attention=f), (TOKENS,)),
  "gpt2": (
    lambda f: gpt2.Model(50, 16, 24, 2, 3, dropout=0.0, fused_attention=f),
    (TOKENS,),
  ),
  "bert": (
    lambda f: bert.Model(
      vocab_size=50,
      max_position=16,
      d_model=24,
      num_layers=2,
      num_heads=3,
      d_ff=40,
      dropout=0.0,
      fused_attention=f,
    ),
    (PADDED,),
  ),
  "t5": (
    lambda f: t5.Model(50, 24, 2, 3, fused_attention=f),
    (PADDED, TOKENS[:, :7]),
  ),
  "t5_v1": (
    lambda f: t5_v1.Model(
      vocab_size=50,
      d_model=16,
      d_kv=8,
      d_ff=40,
      num_layers=2,
      num_heads=3,
      relative_attention_num_buckets=8,
      relative_attention_max_distance=20,
      dropout=0.0,
      fused_attention=f,
    ),
    (PADDED, TOKENS[:, :7]),
  ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_logits_equal_the_explicit_softmax(name):
  make, inputs = CASES[name]
  fused, explicit = make(True), make(False)
  params = fused.init(jax.random.key(1), *inputs, train=False)
  a = fused.apply(params, *inputs, train=False)
  b = explicit.apply(params, *inputs, train=False)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5
    )
  # The fused model's jaxpr holds no [B, H, Lq, Lk] softmax of its own:
  # it calls jax.nn's (a different program from the explicit one's).
  fused_text = str(
    jax.make_jaxpr(lambda p: fused.apply(p, *inputs, train=False))(params)
  )
  explicit_text = str(
    jax.make_jaxpr(lambda p: explicit.apply(p, *inputs, train=False))(params)
  )
  assert fused_text != explicit_text


def test_the_function_against_a_numpy_restatement():
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(2, 5, 3, 4)).astype(np.float32) for _ in range(3))
  bias = rng.normal(size=(1, 3, 5, 5)).astype(np.float32)
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) * 0.5 + bias
  scores = np.where(np.tril(np.ones((5, 5), bool)), scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  expected = np.einsum("bhqk,bkhd->bqhd", weights, v)
  for fused in (True, False):
    got = attention.dot_product_attention(
      jnp.asarray(q),
      jnp.asarray(k),
      jnp.asarray(v),
      bias=jnp.asarray(bias),
      causal=True,
      scale=0.5,
      fused=fused,
    )
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)


def test_dropout_on_the_weights_takes_the_explicit_path():
  """Training with attention dropout: both settings run the explicit
  softmax (same outputs for the same rng), and the dropout does act."""
  make = lambda f: gpt2.Model(50, 16, 24, 2, 3, dropout=0.5, fused_attention=f)  # noqa: E731
  params = make(True).init(jax.random.key(1), TOKENS, train=False)
  rngs = {"dropout": jax.random.key(7)}
  a = make(True).apply(params, TOKENS, train=True, rngs=rngs)
  b = make(False).apply(params, TOKENS, train=True, rngs=rngs)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  quiet = make(True).apply(params, TOKENS, train=False)
  assert not np.allclose(np.asarray(a), np.asarray(quiet))
