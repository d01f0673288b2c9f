"""Metrics out: a JSONL file and TensorBoard event files in the workdir."""

import glob
import json
import os
import sys

from tensorboardX import SummaryWriter

from jpipe.train.errors import UsageError


class MetricLog:
  """Appends ``{"step": s, **scalars}`` lines to ``metrics.jsonl`` and
  writes the same scalars as TensorBoard events under ``tensorboard/``.

  A run that resumes from the checkpoint of step ``resume_step`` keeps
  the metrics up to it and drops the later ones (the steps it trains
  again), in both files, so a resumed run's logs read as one run. A run
  that starts over (``resume_step`` 0: the earlier run left no
  checkpoint) keeps none, and says how many it dropped.
  """

  def __init__(self, workdir: str, resume_step: int = 0):
    self.path = os.path.join(workdir, "metrics.jsonl")
    events = os.path.join(workdir, "tensorboard")
    rows, skipped = _read_rows(self.path)
    if skipped:
      print(
        f"Note: {self.path}: {skipped} unreadable lines dropped (damaged, or "
        f"cut short by a kill); {len(rows)} rows kept.",
        file=sys.stderr,
      )
    kept = [r for r in rows if 0 < resume_step and r["step"] <= resume_step]
    if rows and not resume_step:
      print(
        f"Note: {self.path}: {len(rows)} rows of an earlier run that left "
        "no checkpoint dropped (this run starts over).",
        file=sys.stderr,
      )
    # The training time the kept rows reached: a resumed run's clock
    # goes on from it.
    self.train_seconds = max(
      (
        r["time/train_seconds"]
        for r in kept
        if isinstance(r.get("time/train_seconds"), (int, float))
      ),
      default=0.0,
    )
    try:
      # Rewritten whole, then renamed over the old: a kill meanwhile
      # leaves the old file, not half of it.
      with open(self.path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
      os.replace(self.path + ".tmp", self.path)
      # TensorBoard shows every event file of a folder: rewrite them as one
      # file holding the kept rows (its own purge_step is honoured by
      # TensorBoard's reader only, not by other tools reading the files).
      for old in glob.glob(os.path.join(events, "events.out.tfevents.*")):
        os.remove(old)
      self._tb = SummaryWriter(events)
    except OSError as e:
      raise UsageError(
        f"cannot write the run's logs in {workdir} ({e.strerror}: "
        f"{e.filename}): make the workdir and its files writable"
      ) from e
    for row in kept:
      self._add(
        row["step"],
        {
          k: v
          for k, v in row.items()
          if k != "step" and isinstance(v, (int, float))  # not events
        },
      )

  def write(self, step: int, **scalars: float) -> None:
    values = {k: float(v) for k, v in scalars.items()}
    with open(self.path, "a") as f:
      f.write(json.dumps({"step": step, **values}) + "\n")
    self._add(step, values)

  def _add(self, step, values):
    for name, value in values.items():
      self._tb.add_scalar(name, value, step)

  def write_event(self, step: int, key: str, value) -> None:
    """A ``{"step": step, key: value}`` line (any JSON value, e.g. a
    re-partition's record); not a TensorBoard scalar."""
    with open(self.path, "a") as f:
      f.write(json.dumps({"step": step, key: value}) + "\n")

  def close(self) -> None:
    self._tb.flush()
    self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """The rows of ``WORKDIR/metrics.jsonl`` ([] without one); a line that
  is no row (cut short by a kill mid-write, or damaged) is skipped."""
  return _read_rows(os.path.join(workdir, "metrics.jsonl"))[0]


def _read_rows(path: str) -> tuple[list[dict], int]:
  """(the rows -- objects with an integer "step" -- of a metrics file,
  the lines skipped as no row)."""
  if not os.path.exists(path):
    return [], 0
  rows, skipped = [], 0
  with open(path, "rb") as f:
    for raw in f:
      try:
        row = json.loads(raw.decode("utf-8").lstrip("\ufeff"))
      except (UnicodeDecodeError, json.JSONDecodeError):
        row = None
      if isinstance(row, dict) and type(row.get("step")) is int:
        rows.append(row)
      elif raw.strip():
        skipped += 1
  return rows, skipped
