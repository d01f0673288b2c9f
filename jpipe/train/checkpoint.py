"""Atomic checkpoints of the model-global training state, with orbax.

What is stored: ``Pipeline.state_dict`` (params, optimizer and Gap-Aware
state, model state -- keyed by global parameter path, so another partition
can resume), plus JSON metadata (step = data position, config fingerprint,
the run's id, a CRC-32 per array: a checkpoint whose files were damaged
after the save is refused at restore, naming the array and the earlier
checkpoint to use; so are checkpoints of two runs mixed in one workdir).
orbax writes each step to a temporary directory and renames it when
complete, so a run killed mid-save leaves the previous checkpoint intact.
"""

import contextlib
import errno
import logging
import os
import re
import sys
import threading
import uuid
import zlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jpipe import distributed
from jpipe.train import process_arrays
from jpipe.train.errors import CheckpointError, CheckpointLayoutError

__all__ = [
  "CheckpointError",
  "CheckpointLayoutError",
  "Checkpoints",
  "checksums",
  "orbax_error",
  "quiet_late_reads",
]


class Checkpoints:
  """The checkpoints of one workdir (``WORKDIR/checkpoints/<step>``)."""

  def __init__(self, workdir: str, keep: int):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    # Saved with every checkpoint; a resumed run keeps the one it resumes
    # (check_fingerprint). Only process 0 writes the metadata, so the
    # other processes' ids never land.
    self.run_id = uuid.uuid4().hex[:12]
    self._one_run_checked = None  # The latest step found of one run.
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(
    self, step: int, state: dict, meta: dict, *, per_process: bool = False
  ) -> None:
    """Writes and waits (so a SIGTERM exit has it on disk). ``meta`` gets
    the CRC-32 of every array of ``state`` (host arrays), checked at
    restore. ``per_process``: every process passes its own part (leaves
    held elsewhere as ``jax.ShapeDtypeStruct``) and writes only that
    (``process_arrays``: its index holds the checksums)."""
    if per_process:
      item = process_arrays.ProcessArraysSave(state)
    else:
      item = ocp.args.StandardSave(state)
      meta = dict(meta, checksums=checksums(state))
    meta = dict(meta, run=self.run_id)
    # orbax synchronises the processes with device collectives.
    distributed.quiet("checkpoint")
    args = {process_arrays.ITEM if per_process else "state": item}
    intact = self.latest_step()
    # Before the writes start: a failed write's siblings may print while
    # the failure is on its way to the except clause below.
    quiet_late_reads()
    try:
      with _orbax_errors_unlogged():
        self._manager.save(
          step,
          args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args),
          force=True,
        )
        self._manager.wait_until_finished()
    except Exception as e:
      raise CheckpointError(
        _save_failed(self.directory, step, intact, e)
      ) from e

  def check_fingerprint(self, fingerprint: dict) -> dict | None:
    """The latest checkpoint's metadata (None without one); a
    CheckpointError when it is unreadable, was written for another model,
    or other checkpoints beside it are another run's. Cheap (small JSON
    files): run it before loading data or tracing. The run resumed keeps
    its id."""
    step = self.latest_step()
    if step is None:
      return None
    where, fix = self._where(step)
    try:
      meta = self._meta(step)
    except Exception as e:
      raise CheckpointError(
        f"checkpoint {where} is unreadable ({orbax_error(e)}); {fix}"
      ) from e
    saved = (meta or {}).get("fingerprint")
    if saved != fingerprint:
      # The earlier checkpoints may be the other model's too: point only
      # at one written for this model.
      ours = [
        s
        for s in self._manager.all_steps()
        if s < step and self._field_or_none(s, "fingerprint") == fingerprint
      ]
      if ours:
        fix = (
          f"delete the checkpoints after step {max(ours)} in "
          f"{self.directory} to resume from step {max(ours)} (the latest "
          f"written for this model), or use another --workdir"
        )
      else:
        fix = (
          f"none of its checkpoints is of this model: use another "
          f"--workdir, or delete {self.directory} to start over here"
        )
      raise CheckpointError(
        f"checkpoint {where} was written for another model or optimizer "
        f"({fingerprint_difference(saved, fingerprint)}); {fix}"
      )
    self._check_one_run(step, meta.get("run"))
    self.run_id = meta.get("run") or self.run_id
    return meta

  def _check_one_run(self, step: int, run) -> None:
    """A CheckpointError when checkpoints of another run (another id)
    sit beside the latest, ``step`` of run ``run``: copied in from
    another workdir, they would resume one run with the other's metrics
    and checkpoints around it. Checkpoints without an id (written before
    ids) match any."""
    if not run or self._one_run_checked == step:
      return  # (restore checks again what the start-up checked.)
    runs = {
      s: run if s == step else self._field_or_none(s, "run")
      for s in self._manager.all_steps()
    }
    ours = sorted(s for s, r in runs.items() if r == run)
    theirs = sorted(s for s, r in runs.items() if r and r != run)
    if theirs:
      raise CheckpointError(
        f"{self.directory} holds checkpoints of two runs: steps {ours} of "
        f"run {run} (the latest, step {step}) and steps {theirs} of run "
        f"{'/'.join(sorted({runs[s] for s in theirs}))} (copied in from "
        "another workdir?); keep one run's: delete steps "
        f"{theirs} to resume run {run} from step {step}, or move each "
        "run's checkpoints to its own --workdir"
      )
    self._one_run_checked = step

  def _meta(self, step: int) -> dict | None:
    return self._manager.restore(
      step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
    ).meta

  def _field_or_none(self, step: int, field: str):
    """Checkpoint ``step``'s metadata ``field`` (None where it is
    unreadable: not one to resume from)."""
    try:
      meta = self._meta(step)
    except Exception:
      return None
    return meta.get(field) if isinstance(meta, dict) else None

  def _where(self, step: int) -> tuple[str, str]:
    """A checkpoint's directory and what to do when it cannot be used."""
    where = os.path.join(self.directory, str(step))
    earlier = [s for s in self._manager.all_steps() if s < step]
    fix = (
      f"delete {where} to resume from step {max(earlier)} (the previous "
      f"checkpoint)"
      if earlier
      else f"delete {where} (or the whole {self.directory}) to start over"
    )
    return where, fix + ", or use another --workdir"

  def restore(
    self, template: dict, fingerprint: dict, needed=None, say=print
  ) -> tuple[Any, dict]:
    """The latest (state, meta); ``template`` gives structure and dtypes
    (host arrays, or ``jax.ShapeDtypeStruct`` with ``needed``: booleans in
    its structure, the leaves this process reads; the others stay the
    template's). ``say`` gets the warning of a checkpoint with no
    checksums to check.

    Raises CheckpointError when the files are unreadable, were written
    for another model (``fingerprint`` differs) or for another step than
    their directory's.
    """
    step = self.latest_step()
    meta = self.check_fingerprint(fingerprint)
    where, fix = self._where(step)
    if isinstance(meta.get("step"), int) and meta["step"] != step:
      # Resumed, it would save its next checkpoint over a step that exists.
      raise CheckpointError(
        f"checkpoint {where} says step {meta['step']} in its metadata: "
        f"its directory was renamed or its metadata edited; {fix}"
      )
    # Before the reads start: a failed read's siblings may print while
    # the failure is still on its way to the except clause below.
    quiet_late_reads()
    per_process = os.path.isdir(os.path.join(where, process_arrays.ITEM))
    if per_process:
      if needed is None:
        needed = jax.tree.map(lambda _: True, template)
      item = process_arrays.ProcessArraysRestore(_abstract(template), needed)
    else:
      if needed is not None:  # A gathered checkpoint is read whole.
        template = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), template)
      item = ocp.args.StandardRestore(template)
    name = process_arrays.ITEM if per_process else "state"
    try:
      state = self._manager.restore(
        step, args=ocp.args.Composite(**{name: item})
      )[name]
    except Exception as e:
      if "tree structures do not match" in str(e):  # (Orbax's words.)
        raise CheckpointLayoutError(
          f"checkpoint {where} holds a state laid out unlike this run's "
          f"(first difference: {_first_difference(str(e))}): a setting "
          "that shapes the optimizer's state changed since it was written "
          "(SGD momentum on or off, a learning-rate schedule, weight decay, "
          "the optimizer's arguments); resume with the settings it was "
          "written with, or use another --workdir"
        ) from e
      raise CheckpointError(
        f"checkpoint {where} is corrupt or incompatible "
        f"({orbax_error(e)}); {fix}"
      ) from e
    saved = None if per_process else meta.get("checksums")
    if saved is None and not per_process:
      say(
        f"Warning: checkpoint {where} records no checksums (written before "
        "jpipe recorded them, or its metadata was edited): its arrays are "
        "not checked for damage."
      )
    if saved is not None:
      for path, crc in checksums(state).items():
        if saved.get(path) != crc:
          raise CheckpointError(
            f"checkpoint {where} (step {step}) fails its checksum at "
            f"{path}: its files changed after they were written (disk or "
            f"copy damage); {fix}"
          )
    return state, meta

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def _save_failed(directory: str, step: int, intact, error) -> str:
  """The one line of a save that failed: the cause (a full disk named as
  such) and the checkpoint still there to resume from."""
  cause, full = error, False
  while cause is not None:  # orbax wraps the OS's error.
    full = full or (
      isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
    )
    # tensorstore's writes fail with a ValueError naming the OS's code.
    full = full or f"os_error_code='{errno.ENOSPC}'" in str(cause)
    cause = cause.__cause__ or cause.__context__
  kept = (
    f"step {intact} is intact"
    if intact is not None
    else "there is no earlier checkpoint"
  )
  if full:
    return (
      f"no space left on the disk of {directory} while saving step {step}"
      f"; {kept}: free space (or lower "
      "config.train.keep_checkpoints) and run the same command to resume, "
      "or use another --workdir"
    )
  return (
    f"saving step {step} to {directory} failed ({orbax_error(error)}); "
    f"{kept}: fix the cause and run the same command to resume"
  )


def fingerprint_difference(saved, now) -> str:
  """What differs between a checkpoint's fingerprint and this run's: the
  keys that differ, each ``key: saved A, now B`` (a data-parallel run's
  pipeline count; absent: "none"), or both whole where either is no
  dict."""
  if not isinstance(saved, dict) or not isinstance(now, dict):
    return f"saved {saved}, now {now}"
  keys = [k for k in {**saved, **now} if saved.get(k) != now.get(k)]

  def value(fp, k):
    return repr(fp[k]) if k in fp else _UNSET.get(k, "none")

  return "; ".join(
    f"{_FINGERPRINT_FIELDS.get(k, k)}: saved {value(saved, k)}, now "
    f"{value(now, k)}"
    for k in keys
  )


# Fingerprint keys by the config field that sets them, and what a key
# left out of a fingerprint stands for.
_FINGERPRINT_FIELDS = {
  "task": "config.task",
  "tokenizer": "config.data.tokenizer",
  "model_size": "config.model.size",
  "param_dtype": "config.model.param_dtype",
  "model": "config.model.name",
  "model_kwargs": "config.model.kwargs",
  "optimizer": "config.optimizer.name",
  "freeze": "config.optimizer.freeze",
  "pipelines": "config.data_parallel.pipelines",
}
_UNSET = {
  "pipelines": "1",
  **dict.fromkeys(("task", "model_size", "param_dtype", "freeze"), "''"),
}


class _OrbaxErrorsUnlogged(logging.Filter):
  """Drops orbax's own log records of a failed save: the failure reaches
  the user once, as ``Checkpoints.save``'s one line."""

  def filter(self, record) -> bool:
    return "orbax" not in record.pathname or record.levelno < logging.ERROR


@contextlib.contextmanager
def _orbax_errors_unlogged():
  logger, quiet = logging.getLogger("absl"), _OrbaxErrorsUnlogged()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)


def orbax_error(error: Exception) -> str:
  """An orbax / tensorstore read error in a line: ``array 'a/b':
  NOT_FOUND: the cause`` where tensorstore names the array, else the
  type and the first line (without the JSON specs tensorstore appends,
  ~2 KB)."""
  text = str(error).split(" [tensorstore_spec")[0].strip()
  text = text.splitlines()[0] if text else ""
  array = re.search(r'"([^"]+)/\.zarray"', text)
  if not array:
    return f"{type(error).__name__}: {text[:300]}"
  # tensorstore's: 'CODE: Error ...: Error ...: the cause'.
  code = re.match(r"[A-Z_]{4,}(?=: )", text)
  cause = text.rsplit(": ", 1)[-1].split("; at ")[0]
  return (
    f"array {array.group(1)!r}: "
    + (f"{code.group(0)}: {cause}" if code else cause)[:240]
  )


def _first_difference(orbax_message: str) -> str:
  """``opt_state[0]: dict saved, EmptyState now`` from orbax's
  multi-line report of two tree structures that differ."""
  lines = [line.strip() for line in orbax_message.splitlines()]
  for i, line in enumerate(lines[:-2]):
    if line.endswith(":") and lines[i + 1].startswith("- Source:"):
      # (Orbax's source is the restore item, its target the files.)
      now = lines[i + 1].removeprefix("- Source:").strip()
      saved = lines[i + 2].removeprefix("- Target:").strip()
      return f"{line[:-1]}: {saved} saved, {now} now"
  return lines[0][:200]


def _abstract(template):
  """``template``'s leaves as ``jax.ShapeDtypeStruct``."""
  return jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), template
  )


_late_reads_quiet = False  # quiet_late_reads' hooks are installed.


def quiet_late_reads() -> None:
  """After a failed restore, the reads still under way finish into the
  closed event loop of the restore, and each would print a 6-line
  "RuntimeError: Event loop is closed" traceback around the one-line
  error: as an unraisable exception, or through ``sys.excepthook`` /
  ``threading.excepthook`` (a read's callback on another thread; CI
  once saw one begin before the error reached the CLI, so this is
  installed before a restore starts). Those (only those) are dropped
  from then on; a restore that succeeds raises none. A failed save's
  writes end the same way. Installed once per process (later calls do
  nothing)."""
  global _late_reads_quiet
  if _late_reads_quiet:
    return
  _late_reads_quiet = True

  def late(value) -> bool:
    return (
      isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
    )

  unraisable_hook, except_hook = sys.unraisablehook, sys.excepthook

  def unraisable(unraisable):
    if not late(unraisable.exc_value):
      unraisable_hook(unraisable)

  def excepthook(kind, value, traceback):
    if not late(value):
      except_hook(kind, value, traceback)

  thread_hook = threading.excepthook

  def thread_excepthook(args):
    if not late(args.exc_value):
      thread_hook(args)

  sys.unraisablehook, sys.excepthook = unraisable, excepthook
  threading.excepthook = thread_excepthook


def checksums(state) -> dict[str, str]:
  """``{path: CRC-32 (hex) of the array's bytes}`` for every leaf of a
  pytree of host arrays (paths as ``jax.tree_util.keystr``)."""
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  return {
    jax.tree_util.keystr(path): format(
      zlib.crc32(np.ascontiguousarray(leaf).tobytes()), "08x"
    )
    for path, leaf in flat
  }
