"""Local TFDS datasets: where they live, and building one on first use."""

import contextlib
import fcntl
import io
import os
import sys

import tensorflow_datasets as tfds
from tensorflow_datasets.core.utils import tqdm_utils as tfds_tqdm

DEFAULT_DATA_DIR = os.path.join("~", ".cache", "jpipe", "tensorflow_datasets")


def prepared_source(builder_class, split: str, data_dir: str | None):
  """A ``tfds`` data source of ``split``, building the dataset into
  ``data_dir`` (default ``DEFAULT_DATA_DIR``) as array_record files the
  first time (no TensorFlow needed).

  Processes that start at once (test workers, one process per host) take
  turns on a lock file: TFDS builds into a temporary folder and renames
  it, so a second concurrent build fails on the rename.
  """
  data_dir = os.path.expanduser(data_dir or DEFAULT_DATA_DIR)
  builder = builder_class(data_dir=data_dir, file_format="array_record")
  if not os.path.isdir(builder.data_path):
    os.makedirs(data_dir, exist_ok=True)
    lock_path = os.path.join(data_dir, f".{builder.name}.lock")
    with open(lock_path, "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
      if not os.path.isdir(builder.data_path):
        _build_quietly(builder)
    # Another process may have built it: read what is on disk now.
    builder = builder_class(data_dir=data_dir, file_format="array_record")
  return builder.as_data_source(split=split)


def split_names(split: str) -> list[str]:
  """The split names a TFDS split string reads: "train[:10%]+test" ->
  ["train", "test"]."""
  return [part.split("[")[0].strip() for part in split.split("+")]


def _build_quietly(builder) -> None:
  """``download_and_prepare`` with one line of our own instead of TFDS's
  "Downloading and preparing dataset Unknown size ..." and its progress
  bars (nothing is downloaded: the builders read files that ship with
  Python or scikit-learn)."""
  print(
    f"Building the embedded dataset {builder.name} once into "
    f"{builder.data_dir} (from files installed on this machine; nothing is "
    f"downloaded).",
    file=sys.stderr,  # A status line: stdout may be a JSON plan.
    flush=True,
  )
  was_active = getattr(tfds_tqdm, "_active", True)
  tfds.display_progress_bar(False)
  try:
    with contextlib.redirect_stdout(io.StringIO()):  # TFDS's own lines.
      builder.download_and_prepare()
  finally:
    tfds.display_progress_bar(was_active)
