"""``Pipeline.evaluate(metrics_fn)`` and ``Pipeline.predict``: functions
other than the loss, cut by the pipeline's plan and run forward through
its stages; checked against the same function at the same params on one
device (plain JAX)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from tests.partition import flax_models
from tests.runtime.test_pipeline_sync import _reference_steps
from tests.runtime.test_replicated_stages import LAYOUTS, _replicated
from tests.tiers import slow


def _logits_and_labels(case):
  """``(params, batch) -> (logits, labels)`` of a flax_models case, in
  the loss's own calls of its model."""
  if case == "mlp":
    model = flax_models.Mlp()
    return lambda p, b: (model.apply(p, b["x"]), b["y"])
  if case == "gpt_tied":
    model = flax_models.Gpt()
    return lambda p, b: (
      model.apply(p, b["tokens"][:, :-1]),
      b["tokens"][:, 1:],
    )
  model = flax_models.EncoderDecoder()
  return lambda p, b: (model.apply(p, b["src"], b["tgt"]), b["y"])


def _fns(case):
  """(metrics_fn: per-batch sums, predict_fn: per-example arrays)."""
  logits_and_labels = _logits_and_labels(case)

  def metrics_fn(params, batch):
    logits, labels = logits_and_labels(params, batch)
    hits = jnp.argmax(logits, -1) == labels
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return {
      "correct": jnp.sum(hits),
      "loss_sum": jnp.sum(xent),
      "count": jnp.asarray(labels.size, jnp.float32),
    }

  def predict_fn(params, batch):
    logits, _ = logits_and_labels(params, batch)
    return {"logits": logits, "labels": jnp.argmax(logits, -1)}

  return metrics_fn, predict_fn


def _pipeline(loss_fn, params, batch, stages, **options):
  """A Pipeline of ``stages`` stages, one device each (sgd 0.1 and two
  microbatches unless ``options`` say otherwise)."""
  options = {"num_microbatches": 2, "optimizer": optax.sgd(0.1)} | options
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=stages,
    devices=jax.devices()[: options.pop("devices", stages)],
    **options,
  )


def _check(pipe, state, params, batch, metrics_fn, predict_fn):
  """The pipeline's metrics (summed over microbatches) and predictions
  (concatenated) equal the functions' on one device at ``params``."""
  got = pipe.evaluate(state, batch, metrics_fn)
  want = metrics_fn(params, batch)  # Sums: one batch = its microbatches.
  assert got["correct"] == want["correct"]
  assert float(got["count"]) == float(want["count"])
  np.testing.assert_allclose(got["loss_sum"], want["loss_sum"], rtol=1e-5)
  got = pipe.predict(state, batch, predict_fn)
  want = predict_fn(params, batch)
  np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5)
  np.testing.assert_array_equal(got["labels"], want["labels"])


@pytest.mark.parametrize(
  "case, schedule, stages, devices",
  [
    ("mlp", "1f1b", 3, 3),
    slow("gpt_tied", "gpipe", 4, 4),  # The tied head reads stage 0's leaf.
    slow("encoder_decoder", "1f1b", 3, 3),  # Encoder output to every stage.
    slow("gpt_tied", "zbv", 4, 2),  # Two stages a device, in a V.
  ],
)
def test_metrics_and_predictions_through_the_stages(
  case, schedule, stages, devices
):
  """Before and after two steps (the pipeline's params never gathered:
  the reference trains on one device)."""
  loss_fn, params, batch, _ = flax_models.CASES[case]()
  metrics_fn, predict_fn = _fns(case)
  tx = optax.adam(1e-2)
  pipe = _pipeline(
    loss_fn,
    params,
    batch,
    stages,
    devices=devices,
    schedule=schedule,
    num_microbatches=4,
    optimizer=tx,
  )
  state = pipe.init(params)
  _check(pipe, state, params, batch, metrics_fn, predict_fn)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  expected, _ = _reference_steps(loss_fn, params, batch, 4, tx, steps=2)
  _check(pipe, state, expected, batch, metrics_fn, predict_fn)
  # Half the batch: two microbatches of the same size, one more trace.
  half = jax.tree.map(lambda x: x[: len(x) // 2], batch)
  _check(pipe, state, expected, half, metrics_fn, predict_fn)
  assert len(pipe.forward_programs) == 2  # (Per function, not per size.)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_predictions_on_replica_groups(layout):
  """Stages on replica groups (a microbatch split over a group's devices)
  and a group holding two stages."""
  loss_fn, params, batch, _ = flax_models.CASES["gpt_tied"]()
  metrics_fn, predict_fn = _fns("gpt_tied")
  pipe = _replicated(
    LAYOUTS[layout],
    loss_fn,
    params,
    batch,
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
    schedule="1f1b",
  )
  _check(pipe, pipe.init(params), params, batch, metrics_fn, predict_fn)


@pytest.mark.slow
def test_inference_mode_reads_batchnorm_statistics():
  """A ResNet's accuracy with its running statistics (``train=False``):
  the statistics are read on the stages that keep them, not updated."""
  loss_fn, params, stats, batch = flax_models.resnet_state_case()
  model = flax_models.ResNet()

  def metrics_fn(params, stats, batch):
    logits = model.apply(
      {"params": params, "batch_stats": stats}, batch["x"], train=False
    )
    return {"correct": jnp.sum(jnp.argmax(logits, -1) == batch["y"])}

  def predict_fn(params, stats, batch):
    variables = {"params": params, "batch_stats": stats}
    return model.apply(variables, batch["x"], train=False)

  pipe = _pipeline(loss_fn, params, batch, 3, model_state=stats)
  state, _ = pipe.step(pipe.init(params, stats), batch)  # Stats move.
  params, stats = pipe.gather_params(state), pipe.gather_model_state(state)
  got = pipe.evaluate(state, batch, metrics_fn)
  assert got["correct"] == metrics_fn(params, stats, batch)["correct"]
  np.testing.assert_allclose(
    pipe.predict(state, batch, predict_fn),
    predict_fn(params, stats, batch),
    atol=1e-5,
  )
  after = pipe.gather_model_state(state)
  for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_function_that_stops_early_runs_nothing_on_the_later_stages():
  """The encoder's output only: its results come from an early stage;
  the stages after it have none of the function's equations."""
  loss_fn, params, batch, _ = flax_models.methods_encoder_decoder_case()
  model = flax_models.MethodsEncoderDecoder()

  def encode(params, batch):
    return model.apply({"params": params}, batch["source"], method="encode")

  pipe = _pipeline(loss_fn, params, batch, 3)
  # The loss calls encode from __call__ (nodes "Model.encode/embed"...),
  # the function as the apply method ("embed"...): the same modules.
  assert pipe.stages.stage_of_node[-1] == 2
  got = pipe.predict(pipe.init(params), batch, encode)
  np.testing.assert_allclose(got, encode(params, batch), atol=1e-5)
  program = next(iter(pipe.forward_programs.values()))
  assert program.stages.specs[0].eqns and program.stages.specs[1].eqns
  assert not program.stages.specs[2].eqns  # (The decoder's.)


def test_a_param_read_where_its_stage_does_not_hold_it_is_refused():
  """Arithmetic on params outside any module joins the node that reads
  it: a norm of the head's kernel read at the end runs on the last stage,
  which holds it; the same norm scaling the input joins the first node,
  which cannot read the kernel."""
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  model = flax_models.Mlp()

  def metrics_fn(params, batch):
    norm = jnp.sum(params["params"]["head"]["kernel"] ** 2)
    return {"norm_x_count": norm * model.apply(params, batch["x"]).shape[0]}

  def scaled_fn(params, batch):
    norm = jnp.sum(params["params"]["head"]["kernel"] ** 2)
    return {"sum": model.apply(params, batch["x"] * norm).sum()}

  pipe = _pipeline(loss_fn, params, batch, 2)
  state = pipe.init(params)
  got = pipe.evaluate(state, batch, metrics_fn)["norm_x_count"]
  want = metrics_fn(params, batch)["norm_x_count"]
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  with pytest.raises(ValueError, match=r"reads param .*head.*kernel.* stage 0"):
    pipe.evaluate(state, batch, scaled_fn)


def test_a_batch_that_does_not_split_predicts_as_its_own_examples():
  """Microbatches of 6 (12 examples, 2 microbatches): 7, 5 and 1 examples
  predict each example as the one-device function does (copies of the
  last example fill the last microbatch, their outputs dropped);
  evaluate, which sums, refuses them with the way on."""
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  metrics_fn, predict_fn = _fns("mlp")
  pipe = _pipeline(loss_fn, params, batch, 2)
  state = pipe.init(params)
  for n in (7, 5, 1):
    part = jax.tree.map(lambda x, n=n: x[:n], batch)
    got = pipe.predict(state, part, predict_fn)
    want = predict_fn(params, part)
    assert got["logits"].shape == want["logits"].shape
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5)
    np.testing.assert_array_equal(got["labels"], want["labels"])
  with pytest.raises(ValueError, match="weight leaf"):
    pipe.evaluate(state, part, metrics_fn)
  with pytest.raises(ValueError, match="empty batch"):
    pipe.predict(state, jax.tree.map(lambda x: x[:0], batch), predict_fn)


def test_predict_fn_must_return_per_example_values():
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  pipe = _pipeline(loss_fn, params, batch, 2)
  with pytest.raises(ValueError, match="per-example values"):
    pipe.predict(pipe.init(params), batch, loss_fn)


def test_a_module_the_loss_never_calls_stays_with_the_node_before_it():
  """``follow_plan`` on traces: same names go to the same stage; an extra
  call of a module to its last call's stage; an unknown module with the
  node before it."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, extra=False):
      a, b, c = nn.Dense(4, name="a"), nn.Dense(4, name="b"), nn.Dense(4)
      x = c(b(a(x)))
      if extra:  # A module only evaluation calls, then b again.
        x = b(nn.Dense(4, name="probe")(x))
      return x.sum()

  net = Net()
  x = jnp.ones((2, 4))
  params = net.init(jax.random.key(0), x, extra=True)
  ref = jpipe.partition.trace(lambda p, b: net.apply(p, b), params, x)
  other = jpipe.partition.trace(
    lambda p, b: net.apply(p, b, extra=True), params, x, returns_loss=False
  )
  assert ref.node_names == ("a", "b", "Dense_0")
  assert other.node_names == ("a", "b", "Dense_0", "probe", "b#2")
  got = jpipe.partition.follow_plan(other, ref, [0, 1, 2])
  assert got == [0, 1, 2, 2, 1]


class _Mix(nn.Module):
  """Attention's weights and sum, a module without params."""

  @nn.compact
  def __call__(self, s, k, v):
    return jax.nn.softmax(s * k) * v


class _CachedNet(nn.Module):
  """An attention whose cached call reads its keys and values instead of
  projecting them (as a decoder's cross-attention does)."""

  @nn.compact
  def __call__(self, x, cache=None):
    x = nn.Dense(4, name="embed")(x)
    return nn.Dense(4, name="head")(_Attention(name="attention")(x, cache))


class _Attention(nn.Module):
  @nn.compact
  def __call__(self, x, cache):
    s = jnp.tanh(nn.Dense(4, name="q")(x))
    if cache is None:
      k = 2 * nn.Dense(4, name="k")(x)
      v = nn.Dense(4, name="v")(x)
    else:
      k, v = cache
    h = _Mix(name="mix")(s, k, v)
    return nn.Dense(4, name="o")(h + 1)


def test_code_between_submodule_calls_follows_what_it_reads():
  """A cached call skips the k and v projections, so the attention's own
  code after ``mix`` is ``attention#2`` there, ``attention#3`` in the
  loss; by name it would take the loss's ``attention#2`` (stage 0)
  before the ``mix`` it reads (stage 1). It reads no params: it goes
  after its input; the rest keep their names' stages."""
  net = _CachedNet()
  x = jnp.ones((2, 4))
  params = net.init(jax.random.key(0), x)
  ref = jpipe.partition.trace(
    lambda p, b: net.apply(p, b).sum(), params, x, depth=2
  )
  batch = {"x": x, "k": x, "v": x}
  cached = jpipe.partition.trace(
    lambda p, b: net.apply(p, b["x"], (b["k"], b["v"])),
    params,
    batch,
    depth=2,
    returns_loss=False,
  )
  assert ref.node_names[5:8] == ("attention/v", "attention/mix", "attention#3")
  assert cached.node_names == (
    "embed",
    "attention/q",
    "attention",
    "attention/mix",
    "attention#2",
    "attention/o",
    "head",
  )
  got = jpipe.partition.follow_plan(cached, ref, [0] * 6 + [1] * 4)
  assert got == [0, 0, 0, 1, 1, 1, 1]
  stages = jpipe.partition.Stages(cached, got, num_stages=2)  # Data flow.
  assert [len(spec.param_leaves) for spec in stages.specs] == [4, 4]


@pytest.mark.slow
def test_streaming_tied_replicas_read_the_owners_value():
  """Asynchronous: a tied embedding's holder never steps its own copy;
  evaluation and prediction use the owner's current value, as the
  gathered params hold it (the loss too)."""
  loss_fn, params, batch, _ = flax_models.CASES["gpt_tied"]()
  metrics_fn, predict_fn = _fns("gpt_tied")
  pipe = _pipeline(
    loss_fn,
    params,
    batch,
    3,
    schedule="async",
    num_microbatches=4,
    optimizer=optax.sgd(0.5),
    weight_stashing=True,
  )
  assert pipe.tied.replicas  # (The head holds a replica of the embedding.)
  state = pipe.init(params)
  for _ in range(3):
    state, _ = pipe.step(state, batch)
  state, _ = pipe.flush(state)
  gathered = pipe.gather_params(state)
  _check(pipe, state, gathered, batch, metrics_fn, predict_fn)
  loss = float(pipe.evaluate(state, batch)["loss"])
  # (The mean of equal microbatches' mean losses: the batch's.)
  want = float(loss_fn(gathered, batch))
  assert loss == pytest.approx(want, rel=1e-5)
