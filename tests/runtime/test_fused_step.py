"""A stream's step in the program of the backward right before it
(``Partitioning.fuse_step``): the same params, optimizer state and loss
to the bit as the separate programs, a third fewer program calls, and
only where the step reads the gradient as the backward left it.

Compiled with XLA's optimisations on (``xla_optimizations``): what could
change the bits is how XLA fuses the update with the code around it."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import jpipe
from jpipe import schedule as schedule_lib
from tests.partition import flax_models

pytestmark = pytest.mark.usefixtures("xla_optimizations")

F, B, S = schedule_lib.FORWARD, schedule_lib.BACKWARD, schedule_lib.UPDATE


def _next_action_is_step(lists, fused=frozenset()):
  """The plain restatement: for each B(s, b), the next action of stage s
  on its device is S(s, .) (and, for a pair fused with its forward, the
  one before it is F(s, b))."""
  pairs = set()
  for acts in lists.device_actions:
    for a in acts:
      if a.kind != B:
        continue
      same = [x for x in acts if x.stage == a.stage]
      j = same.index(a)
      if j + 1 < len(same) and same[j + 1].kind == S:
        if (a.stage, a.microbatch) in fused:
          if j == 0 or same[j - 1] != schedule_lib.Action(
            F, a.stage, a.microbatch
          ):
            continue
        pairs.add((a.stage, a.microbatch))
  return pairs


@pytest.mark.parametrize("step_every", [1, 2, 3])
@pytest.mark.parametrize("stage_device", [(0, 1, 2, 3), (0, 0, 1, 1)])
def test_step_fusable_backwards_match_the_restatement(step_every, stage_device):
  stream = schedule_lib.Stream("async", 4, step_every=step_every)
  lists = schedule_lib.place(
    "async",
    [stream.stage_actions(s, 0, 12) for s in range(4)],
    stage_device,
  )
  fused = schedule_lib.fusable_pairs(lists, (False, False, False, True))
  got = schedule_lib.step_fusable_backwards(lists, fused)
  assert got == _next_action_is_step(lists, fused)
  # Property: one per step of every stage whose window ends in the call.
  steps = sum(a.kind == S for acts in lists.device_actions for a in acts)
  assert len(got) == steps


def test_a_forward_between_a_fused_pair_keeps_its_step_apart():
  """F0 F1 B0 S: B0 runs in F0's program, before F1; its step may not
  run there (F1 would read the stepped params)."""
  actions = [
    schedule_lib.Action(F, 0, 0),
    schedule_lib.Action(F, 0, 1),
    schedule_lib.Action(B, 0, 0),
    schedule_lib.Action(S, 0, 0),
    schedule_lib.Action(B, 0, 1),
    schedule_lib.Action(S, 0, 1),
  ]
  lists = schedule_lib.make_schedule("custom", [actions], [0], 2)
  fused = schedule_lib.fusable_pairs(lists, [True])
  assert fused == {(0, 0)}
  assert schedule_lib.step_fusable_backwards(lists, fused) == {(0, 1)}
  assert schedule_lib.step_fusable_backwards(lists) == {(0, 0), (0, 1)}


def _train(fuse_step, *, num_stages=4, case="mlp", **options):
  """A stream of 3 steps and a flush: (pipeline, its final params and
  optimizer states, the steps' losses)."""
  loss_fn, params, batch, _ = flax_models.CASES[case]()
  stage_devices = options.pop("stage_devices", None)

  def build(**more):
    return jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=num_stages,
      devices=jax.devices()[:num_stages],
      schedule="async",
      num_microbatches=4,
      fuse_step=fuse_step,
      **options,
      **more,
    )

  pipe = build()
  if stage_devices is not None:  # The same stages, sharing devices.
    plan = dataclasses.replace(pipe.plan, stage_devices=stage_devices)
    pipe = build(partition=plan)
  state = pipe.init(params)
  losses = []
  for _ in range(3):
    state, metrics = pipe.step(state, batch)
    losses.append(float(metrics["loss"]))
  state, _ = pipe.flush(state)
  return pipe, jax.device_get((state.stage_params, state.opt_states)), losses


def _fused_stages(pipe):
  """Stages that ran a backward-and-step program."""
  return {
    key[1]
    for key in pipe.driver.programs._cache
    if str(key[0]).endswith("_step")
  }


@pytest.mark.parametrize(
  "options",
  [
    {"optimizer": optax.sgd(0.05, momentum=0.9)},
    {
      "optimizer": optax.sgd(0.05, momentum=0.9),
      "weight_stashing": True,
      "prediction": "msnag",
    },
    {"optimizer": optax.adamw(1e-2), "recompute": True},
    {"optimizer": optax.adam(1e-2), "fuse_last_stage": False},
    {
      "optimizer": optax.sgd(0.1),
      "gap_aware": "ga",
      "gap_aware_options": {"optimizer": "sgd", "learning_rate": 0.1},
      "recompute": True,
    },
    {"optimizer": optax.adam(1e-2), "stage_devices": ((0,), (0,), (1,), (1,))},
  ],
  ids=[
    "momentum",
    "stash_msnag",
    "adamw_recompute",
    "unfused_last",
    "ga",
    "two_stages_a_device",
  ],
)
@pytest.mark.slow
def test_fused_step_trains_bit_identically(options):
  fused, got, got_losses = _train(True, **dict(options))
  plain, want, want_losses = _train(False, **dict(options))
  assert got_losses == want_losses
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert _fused_stages(fused) == set(range(4))
  assert _fused_stages(plain) == set()
  # Their steps ran inside: no stage compiled a separate packed step.
  assert all(not opt._packed_updates for opt in fused.driver.optimizers)


def test_a_window_of_several_microbatches_steps_in_its_own_program():
  """step_every = 3: the window's last backward has an accumulator to
  add to, and the step stays apart (Adam's moments differed in the last
  bit when it ran inside)."""
  fused, got, _ = _train(True, optimizer=optax.adam(1e-2), step_every=3)
  _, want, _ = _train(False, optimizer=optax.adam(1e-2), step_every=3)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert _fused_stages(fused) == set()


def test_steps_that_read_the_global_norm_stay_apart():
  options = {
    "optimizer": optax.sgd(0.05, momentum=0.9),
    "clip_global_norm": 1.0,
  }
  fused, got, got_losses = _train(True, **dict(options))
  _, want, want_losses = _train(False, **dict(options))
  assert got_losses == want_losses
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert _fused_stages(fused) == set()


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.slow
def test_a_tied_leafs_holder_and_owner_step_in_their_backwards(optimizer):
  """A tied embedding: its holder (the last stage) hands its replica's
  gradient on from its fused program; its owner (the first), whose
  holders' gradients for a microbatch all arrive before its backward of
  it in these orders, adds them in its own fused program. The same bits
  as the separate steps."""
  tx = {
    "momentum": optax.sgd(0.05, momentum=0.9),
    "adam": optax.adam(1e-2),
  }[optimizer]
  options = {"optimizer": tx, "case": "gpt_tied", "num_stages": 3}
  fused, got, got_losses = _train(True, **dict(options))
  _, want, want_losses = _train(False, **dict(options))
  assert got_losses == want_losses
  jax.tree.map(np.testing.assert_array_equal, got, want)
  tied = fused.driver.tied
  assert set(tied.owned) == {0} and set(tied.replicas) == {2}
  assert _fused_stages(fused) == {0, 1, 2}
  # The owner's fused program took the holder's gradient (one position).
  added = {
    key[5]
    for key in fused.driver.programs._cache
    if key[0].endswith("_step") and key[1] == 0
  }
  assert added == {(tied.owned[0][0][0],)}
  assert not any(opt._packed_updates for opt in fused.driver.optimizers)


def test_an_owner_whose_holders_gradient_comes_after_its_backward_waits():
  """``_late_tied_grads``: an owner's backward of b that runs before a
  holder's gradient for b arrives (a MOVE or RECV of "tied_grad" later in
  the ops) keeps its step apart; one after, or a send, does not."""
  from jpipe.runtime.execute.driver import _late_tied_grads

  Action, Move = schedule_lib.Action, schedule_lib.Move
  kinds = schedule_lib.MoveKind

  def tied_grad(kind, b, owner=0):
    return Move(
      kind,
      Action(S, 2, b),
      schedule_lib.Transfer("tied_grad", 2, owner, 0),
    )

  ops = [
    tied_grad(kinds.MOVE, 0),
    Action(B, 0, 0),  # After its gradient: may fuse.
    Action(B, 0, 1),
    tied_grad(kinds.RECV, 1),  # After B(0, 1): late.
    Action(F, 0, 2),  # Runs B(0, 2) (a fused pair).
    tied_grad(kinds.MOVE, 2),
    Action(B, 0, 3),
    tied_grad(kinds.SEND, 3, owner=1),  # Another process's owner.
    tied_grad(kinds.MOVE, 4),  # Its backward in a later call.
  ]
  assert _late_tied_grads(ops, frozenset({(0, 2)})) == {(0, 1), (0, 2)}
  assert _late_tied_grads(ops, frozenset()) == {(0, 1)}


def test_profiled_timeline_shows_the_backward_spanning_its_step():
  """A profiled call still has every action: the S of a step that ran in
  its backward's program is an instant after that B."""
  pipe, _, _ = _train(True, optimizer=optax.sgd(0.05))
  loss_fn, params, batch, _ = flax_models.mlp_case()
  state = pipe.init(params)
  state, _ = pipe.step(state, batch)
  _, metrics = pipe.step(state, batch, profile=True)
  timeline = metrics["timeline"]
  steps = [a for a in timeline.start if a.kind == S]
  assert len(steps) == 4 * 4
  fused = pipe.calls(state.in_flight.fed, 4).fused_steps
  assert fused
  for s, b in fused:
    backward = schedule_lib.Action(B, s, b)
    step = next(a for a in steps if a.stage == s and a.microbatch == b)
    assert timeline.end[backward] <= timeline.start[step]
