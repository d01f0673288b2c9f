"""Atomic checkpoints of the model-global training state, with orbax.

What is stored: ``Pipeline.state_dict`` (params, optimizer and Gap-Aware
state, model state -- keyed by global parameter path, so another partition
can resume), plus JSON metadata (step = data position, config fingerprint).
orbax writes each step to a temporary directory and renames it when
complete, so a run killed mid-save leaves the previous checkpoint intact.
"""

import os
from typing import Any

import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
  """A checkpoint exists but cannot be used."""


class Checkpoints:
  """The checkpoints of one workdir (``WORKDIR/checkpoints/<step>``)."""

  def __init__(self, workdir: str, keep: int):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: dict, meta: dict) -> None:
    """Writes and waits (so a SIGTERM exit has it on disk)."""
    self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
      ),
      force=True,
    )
    self._manager.wait_until_finished()

  def restore(self, template: dict, fingerprint: dict) -> tuple[Any, dict]:
    """The latest (state, meta); ``template`` gives structure and dtypes.

    Raises CheckpointError when the files are unreadable or were written
    for another model (``fingerprint`` differs).
    """
    step = self.latest_step()
    where = os.path.join(self.directory, str(step))
    fix = (
      f"delete {where} (or the whole {self.directory}) to start over, or "
      f"use another --workdir"
    )
    try:
      meta = self._manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
      ).meta
    except Exception as e:
      raise CheckpointError(
        f"checkpoint {where} is unreadable ({type(e).__name__}: {e}); {fix}"
      ) from e
    saved = (meta or {}).get("fingerprint")
    if saved != fingerprint:
      raise CheckpointError(
        f"checkpoint {where} was written for another model or optimizer "
        f"(saved {saved}, now {fingerprint}); {fix}"
      )
    try:
      state = self._manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(template)),
      ).state
    except Exception as e:
      raise CheckpointError(
        f"checkpoint {where} is corrupt or incompatible "
        f"({type(e).__name__}: {e}); {fix}"
      ) from e
    return state, meta

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
