"""Local TFDS datasets: where they live, building one on first use, and
reading one whose files may be damaged."""

import contextlib
import fcntl
import io
import os
import sys

import tensorflow_datasets as tfds
from tensorflow_datasets.core.utils import tqdm_utils as tfds_tqdm

DEFAULT_DATA_DIR = os.path.join("~", ".cache", "jpipe", "tensorflow_datasets")


class DatasetError(ValueError):
  """A prepared dataset whose files cannot be read (damaged on disk,
  truncated, not TFDS's); the message names the folder and the fix."""


class CheckedSource:
  """A TFDS data source whose reads raise :class:`DatasetError` naming
  the dataset's folder and ``fix`` instead of the record reader's error
  ("Corrupted Riegeli/records file: chunk data hash mismatch ...").

  Only ``len`` and integer indexing, as the input pipelines use it.
  """

  def __init__(self, source, where: str, fix: str):
    self._source, self._where, self._fix = source, where, fix
    _check_record_counts(source, where, fix)

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int):
    try:
      return self._source[index]
    except (IndexError, KeyError, TypeError):  # The caller's index.
      raise
    except Exception as e:  # The reader's, decoder's, file system's.
      raise DatasetError(
        f"the dataset in {self._where} cannot be read (record {index}): "
        f"{_first_line(e)}; {self._fix}"
      ) from e


def _check_record_counts(source, where: str, fix: str) -> None:
  """A DatasetError where an array_record shard holds another number of
  records than the dataset's metadata says (metadata edited or swapped,
  a shard replaced): TFDS would read past it or leave records unread."""
  info = getattr(source, "dataset_info", None)
  split = getattr(source, "split", None)
  if info is None or not isinstance(split, str):
    return  # (Not an array_record source.)
  from array_record.python import array_record_module

  for name in split_names(split):
    if name not in info.splits:
      continue  # (TFDS names the unknown split itself.)
    shards = info.splits[name]
    for path, length in zip(
      shards.filepaths, shards.shard_lengths, strict=True
    ):
      if ".array_record" not in str(path):
        return
      try:
        reader = array_record_module.ArrayRecordReader(os.fspath(path))
        held = reader.num_records()
        reader.close()
      except Exception as e:  # Missing or unreadable: the reads would fail.
        raise DatasetError(
          f"the dataset in {where} cannot be read ({os.path.basename(str(path))}"
          f": {_first_line(e)}); {fix}"
        ) from e
      if held != length:
        raise DatasetError(
          f"the dataset in {where} does not match its metadata: "
          f"{os.path.basename(str(path))} holds {held} records, its "
          f"dataset_info.json says {length}; {fix}"
        )


def open_checked(open_source, where: str, fix: str) -> CheckedSource:
  """``open_source()`` (a TFDS data source) as a :class:`CheckedSource`;
  a :class:`DatasetError` if its metadata or files do not open."""
  try:
    source = open_source()
  except Exception as e:  # Damaged metadata: protobuf's, JSON's, ...
    raise DatasetError(
      f"the dataset in {where} does not open: {_first_line(e)}; {fix}"
    ) from e
  return CheckedSource(source, where, fix)


def _first_line(error: Exception) -> str:
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0] if text else ''}"


def prepared_source(builder_class, split: str, data_dir: str | None):
  """A ``tfds`` data source of ``split``, building the dataset into
  ``data_dir`` (default ``DEFAULT_DATA_DIR``) as array_record files the
  first time (no TensorFlow needed).

  Processes that start at once (test workers, one process per host) take
  turns on a lock file: TFDS builds into a temporary folder and renames
  it, so a second concurrent build fails on the rename. A built dataset
  whose files are damaged raises :class:`DatasetError` (when opened or
  read) telling to delete its folder, which the next run rebuilds.
  """
  data_dir = os.path.expanduser(data_dir or DEFAULT_DATA_DIR)
  folder = os.path.join(
    data_dir, builder_class.name, str(builder_class.VERSION)
  )
  if not os.path.isdir(folder):
    os.makedirs(data_dir, exist_ok=True)
    lock_path = os.path.join(data_dir, f".{builder_class.name}.lock")
    with open(lock_path, "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
      if not os.path.isdir(folder):
        _build_quietly(
          builder_class(data_dir=data_dir, file_format="array_record")
        )
  try:
    builder = builder_class(data_dir=data_dir, file_format="array_record")
    empty = not builder.info.splits[split].num_examples
  except Exception:  # (Damaged metadata: opening it below says so.)
    empty = False
  if empty:  # (TFDS would fail to open it, as if damaged.)
    raise DatasetError(
      f"split {split!r} of {builder_class.name} selects no examples: "
      "widen its slice (config.data.train_split / eval_split)"
    )
  return open_checked(
    # Another process may have built it: read what is on disk now.
    lambda: builder_class(
      data_dir=data_dir, file_format="array_record"
    ).as_data_source(split=split),
    folder,
    f"delete {folder} and run again to rebuild it (from files installed here)",
  )


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
