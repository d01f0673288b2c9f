"""One table of schedules: ``jpipe.schedule.REGISTRY``."""

import os
import re

import jax
import optax
import pytest

import jpipe
from jpipe import schedule as sc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_the_name_lists_are_views_of_the_registry():
  assert sc.SCHEDULES == tuple(sc.REGISTRY)
  assert set(sc.SYNCHRONOUS) | set(sc.STREAMS) == set(sc.SCHEDULES)
  assert not set(sc.SYNCHRONOUS) & set(sc.STREAMS)
  assert sc.STREAMS == ("async", "2bw")
  for name, kind in sc.REGISTRY.items():
    assert kind.name == name and kind.summary


@pytest.mark.parametrize("name", ["seq", "gpipe", "1f1b", "interleaved"])
def test_a_kind_on_its_own_devices_is_the_named_schedule(name):
  one = sc.lookup(name).on_devices([0, 1, 2], 5)
  assert one.device_actions == sc.build(name, 3, 5).device_actions


def test_on_shared_devices_each_device_runs_its_stages_actions():
  # Stages 0 and 2 on device 0 (a mixed pipe): the per-stage orders are
  # 1F1B's, merged on the device.
  placed = sc.lookup("1f1b").on_devices([0, 1, 0], 4)
  alone = sc.build("1f1b", 3, 4)
  for s, d in enumerate([0, 1, 0]):
    mine = [a for a in placed.device_actions[d] if a.stage == s]
    assert mine == [a for a in alone.device_actions[s] if a.stage == s]


def test_lookup_refuses_an_unknown_name_naming_the_choices():
  with pytest.raises(ValueError, match=r"unknown schedule 'zb'.*'1f1b'"):
    sc.lookup("zb")
  assert sc.lookup(sc.REGISTRY["gpipe"]) is sc.REGISTRY["gpipe"]


def test_the_readme_names_every_schedule():
  readme = open(os.path.join(ROOT, "README.md")).read()
  line = re.search(r"Schedules \(`jpipe.schedule`\):(.*?)each", readme, re.S)
  assert tuple(re.findall(r"`([^`]+)`", line.group(1))) == sc.SCHEDULES


def test_pipeline_takes_a_schedule_kind():
  params = {"w": jax.numpy.ones((4, 4))}
  batch = {"x": jax.numpy.ones((4, 4))}

  def loss_fn(params, batch):
    return (batch["x"] @ params["w"]).sum()

  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=1,
    schedule=sc.REGISTRY["1f1b"],
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
  )
  assert pipe.schedule_name == "1f1b"


def test_stale_and_two_version_kinds_stream():
  """What the runtime and the config checks ask of a kind instead of its
  name: the staleness mitigations apply where a backward may read newer
  params than its forward (PipeDream's async only), two weight versions
  and a step per minibatch are 2BW's; both stream across calls."""
  assert sc.STALE == ("async",)
  assert [n for n, k in sc.REGISTRY.items() if k.two_versions] == ["2bw"]
  for kind in sc.REGISTRY.values():
    if kind.stale or kind.two_versions:
      assert kind.asynchronous, kind.name
    assert not (kind.stale and kind.two_versions)
  assert set(sc.STREAMS) == {"async", "2bw"}


@pytest.mark.parametrize(
  "name", ["interleaved", "interleaved_zb", "looped_bfs"]
)
def test_a_loop_kind_places_more_stages_than_devices_in_a_loop(name):
  """Megatron's virtual stages: stage s on device s mod p, only given
  more stages than devices; an uneven count is one line."""
  kind = sc.lookup(name)
  assert kind.loops
  assert kind.stage_devices(6, 3) == (0, 1, 2, 0, 1, 2)
  assert kind.stage_devices(3, 3) is None and kind.stage_devices(6) is None
  with pytest.raises(ValueError, match="5 stages on 2 devices is uneven"):
    kind.stage_devices(5, 2)
  for other in ("1f1b", "zbh1", "zbv"):
    assert not sc.lookup(other).loops


def _four_layers(devices: int, **options):
  """A Pipeline of a plain-JAX loss of four named layers (4 x 4) on the
  first ``devices`` devices."""
  params = {f"w{i}": jax.numpy.eye(4) for i in range(4)}

  def loss_fn(params, batch):
    x = batch["x"]
    for i in range(4):
      with jax.named_scope(f"layer{i}"):
        x = jax.numpy.tanh(x @ params[f"w{i}"])
    return x.sum()

  return jpipe.Pipeline(
    loss_fn,
    params,
    {"x": jax.numpy.ones((4, 4))},
    devices=jax.devices()[:devices],
    optimizer=optax.sgd(0.1),
    **options,
  )


def test_pipeline_loops_an_interleaved_schedule_over_its_devices():
  """``interleaved`` with 4 stages on 2 devices: stages 0, 2 on device 0
  and 1, 3 on device 1 (no Plan needed); 1f1b refuses the same, naming
  the loop schedules; 3 stages on 2 devices is uneven."""

  def build(schedule, stages):
    return _four_layers(
      devices=2, num_stages=stages, schedule=schedule, num_microbatches=2
    )

  pipe = build("interleaved", 4)
  assert pipe.plan.stage_devices == ((0,), (1,), (0,), (1,))
  with pytest.raises(ValueError, match="or a loop schedule"):
    build("1f1b", 4)
  with pytest.raises(ValueError, match="3 stages on 2 devices is uneven"):
    build("interleaved", 3)
  # One stage a device: 1f1b's order, not the interleaving asked for.
  with pytest.raises(ValueError, match="runs '1f1b''s order"):
    build("interleaved", 2)


@pytest.mark.parametrize(
  "name", ["interleaved", "interleaved_zb", "looped_bfs"]
)
def test_a_loop_with_one_stage_a_device_is_its_unlooped_schedule(name):
  """What the refusal of a loop on one stage a device names: the same
  device lists, action for action."""
  kind = sc.lookup(name)
  for p, m in [(1, 3), (2, 4), (3, 5), (4, 8)]:
    looped = sc.build(name, p, m)
    assert looped.device_actions == sc.build(kind.unlooped, p, m).device_actions


def test_one_cpu_device_names_the_fake_devices_flag():
  """4 stages on one CPU device: the refusal names XLA's flag for fake
  host devices (a CPU user's usual fix); on 2 devices it does not."""
  with pytest.raises(ValueError, match="force_host_platform_device_count=N"):
    _four_layers(devices=1, num_stages=4)
  with pytest.raises(ValueError, match="got 2") as refused:
    _four_layers(devices=2, num_stages=4)
  assert "XLA_FLAGS" not in str(refused.value)
