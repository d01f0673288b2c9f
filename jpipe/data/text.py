"""A byte-level text corpus: the Python standard library's own source files.

Real text (about 4.7 MB of Python and docstrings in CPython 3.11's top-level
``*.py`` files) that every Python installation carries, so language-model
configs need no download. Built once into ``data_dir`` as array_record
files (no TensorFlow needed), then read with ``tfds`` data sources. The
split is by file and fixed: a file is ``test`` when the CRC-32 of its name
is divisible by 10 (about a tenth of the files), else ``train``. The
corpus is the installation's standard library, so it is deterministic for
one Python version and differs (a little) between versions.
"""

import glob
import os
import sysconfig
import zlib

import numpy as np
import tensorflow_datasets as tfds

from jpipe.data._local_tfds import prepared_source

SEPARATOR = 0  # Byte between files; never occurs in source text.


def stdlib_files() -> list[str]:
  """The standard library's top-level ``*.py`` files, sorted."""
  return sorted(
    glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))
  )


def is_test_file(name: str) -> bool:
  """The fixed split: CRC-32 of the base name divisible by 10."""
  return zlib.crc32(os.path.basename(name).encode()) % 10 == 0


class StdlibBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A data set made from what ships with Python: a train and a test
  split, nothing to download. Subclasses give ``_info`` and
  ``_generate_examples(test)``."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}

  def _split_generators(self, dl_manager):
    del dl_manager  # The data ships with Python: nothing to download.
    return {
      "train": self._generate_examples(test=False),
      "test": self._generate_examples(test=True),
    }


class StdlibText(StdlibBuilder):
  """One example per source file: ``text`` (its bytes) and ``name``."""

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=__doc__,
      features=tfds.features.FeaturesDict(
        {"text": tfds.features.Text(), "name": tfds.features.Text()}
      ),
      homepage="https://docs.python.org/3/library/",
    )

  def _generate_examples(self, test: bool):
    for path in stdlib_files():
      name = os.path.basename(path)
      if is_test_file(name) != test:
        continue
      with open(path, "rb") as f:
        raw = f.read()
      # Files should be UTF-8 (PEP 3120); should one not be, keep
      # the text lossless as bytes by decoding latin-1 in that case.
      try:
        text = raw.decode("utf-8")
      except UnicodeDecodeError:
        text = raw.decode("latin-1")
      yield name, {"text": text, "name": name}


def load_stdlib_text(split: str, data_dir: str | None = None) -> np.ndarray:
  """One split as a byte stream, building the dataset on first use.

  Args:
    split: "train" or "test" (TFDS slicing such as "train[:10]" works).
    data_dir: TFDS data dir; default ``~/.cache/jpipe/tensorflow_datasets``.

  Returns:
    uint8 [N]: the UTF-8 bytes of the split's files in file-name order,
    each followed by ``SEPARATOR``.
  """
  source = prepared_source(StdlibText, split, data_dir)
  records = sorted(
    (source[i] for i in range(len(source))), key=lambda r: r["name"]
  )
  return concatenate_texts(r["text"] for r in records)


def concatenate_texts(texts) -> np.ndarray:
  """uint8 [N]: each text's UTF-8 bytes followed by ``SEPARATOR``."""
  parts = []
  for text in texts:
    if isinstance(text, str):
      text = text.encode("utf-8")
    parts.append(np.frombuffer(text, np.uint8))
    parts.append(np.array([SEPARATOR], np.uint8))
  if not parts:
    return np.zeros([0], np.uint8)
  return np.concatenate(parts)
