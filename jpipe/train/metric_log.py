"""Metrics out: a JSONL file and TensorBoard event files in the workdir."""

import json
import os

from tensorboardX import SummaryWriter


class MetricLog:
  """Appends ``{"step": s, **scalars}`` lines to ``metrics.jsonl`` and
  writes the same scalars as TensorBoard events under ``tensorboard/``."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, **scalars: float) -> None:
    values = {k: float(v) for k, v in scalars.items()}
    with open(self.path, "a") as f:
      f.write(json.dumps({"step": step, **values}) + "\n")
    for name, value in values.items():
      self._tb.add_scalar(name, value, step)

  def close(self) -> None:
    self._tb.flush()
    self._tb.close()
