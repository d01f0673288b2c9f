"""The per-action programs' XLA options: no CUDA graphs on GPUs unless
asked for, nothing elsewhere, and the same results either way."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe.runtime import Partitioning
from jpipe.runtime.build import phases as _build
from jpipe.runtime.build import programs as _programs
from tests.runtime.test_pipeline_async import mlp_pipeline

GPU_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


# ids: a test keyed "gpu" is taken for one that needs a GPU (conftest).
@pytest.mark.parametrize(
  "platform", ["gpu", "cuda", "rocm"], ids=["nvidia", "cuda", "rocm"]
)
def test_accelerator_programs_leave_out_command_buffers_unless_asked(
  platform,
):
  assert _programs.compiler_options(platform, False) == GPU_OPTIONS
  assert _programs.compiler_options(platform, True) == {}


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_other_platforms_get_no_options(platform):
  assert _programs.compiler_options(platform, False) == {}


def test_the_option_is_one_this_xla_knows():
  # An unknown name fails every compile ("No such compile option"): a
  # renamed flag would break every GPU pipeline, so compile with it here.
  f = _programs.jit(lambda x: x * 2, _programs.compiler_options("cuda", False))
  np.testing.assert_array_equal(f(jnp.arange(3.0)), [0.0, 2.0, 4.0])


@pytest.mark.parametrize(
  "schedule, asked, graphs",
  [
    ("gpipe", None, True),
    ("1f1b", None, True),
    ("async", None, False),
    ("2bw", None, False),
    ("async", True, True),
    ("1f1b", False, False),
  ],
)
def test_auto_records_graphs_for_synchronous_schedules_only(
  schedule, asked, graphs
):
  # On a GPU the options follow the schedule unless the user says.
  class Device:
    platform = "cuda"

  request = SimpleNamespace(
    devices=(Device(),),
    partitioning=Partitioning(num_stages=2, gpu_command_buffers=asked),
    schedule_kind=jpipe.schedule.REGISTRY[schedule],
  )
  assert _build.program_options(request) == ({} if graphs else GPU_OPTIONS)


def _pipeline_with(monkeypatch, options):
  """An async MLP pipeline whose programs get ``options`` (pretending the
  CPU is a platform that has them)."""
  with monkeypatch.context() as patch:
    patch.setattr(_build, "compiler_options", lambda platform, cb: options)
    return mlp_pipeline(
      "async", optax.adam(1e-2), 3, num_stages=3, weight_stashing=True
    )


def test_the_options_reach_the_stage_programs_and_optimizers(monkeypatch):
  # An option XLA does not know fails the compile of whatever carries it.
  pipe, params, batch = _pipeline_with(monkeypatch, {"xla_jpipe_bogus": ""})
  assert pipe.stages.compiler_options == {"xla_jpipe_bogus": ""}
  with pytest.raises(Exception, match="xla_jpipe_bogus"):
    pipe.step(pipe.init(params), batch)
  leaves = pipe.stages.split_params(params)[0]
  with pytest.raises(Exception, match="xla_jpipe_bogus"):
    pipe.stage_optimizers[0].init(leaves)
  with pytest.raises(Exception, match="xla_jpipe_bogus"):
    pipe.programs.unpack(0)(pipe.programs.grad_layouts[0].pack(leaves))


@pytest.mark.slow
def test_accelerator_options_give_the_same_training(monkeypatch):
  def train(pipe, params, batch):
    state = pipe.init(params)
    for _ in range(2):
      state, metrics = pipe.step(state, batch)
    return state, metrics

  plain = mlp_pipeline(
    "async", optax.adam(1e-2), 3, num_stages=3, weight_stashing=True
  )
  assert plain[0].stages.compiler_options == {}
  gpu = _pipeline_with(monkeypatch, dict(GPU_OPTIONS))
  assert gpu[0].programs.options == GPU_OPTIONS
  (a, ma), (b, mb) = train(*plain), train(*gpu)
  np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-6)
  for x, y in zip(
    jax.tree.leaves(a.stage_params),
    jax.tree.leaves(b.stage_params),
    strict=True,
  ):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
