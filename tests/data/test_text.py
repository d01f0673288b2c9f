"""The embedded standard-library text corpus is complete and deterministic."""

import os

import numpy as np
import pytest

from jpipe import data
from jpipe.data import text


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def _expected(test: bool) -> np.ndarray:
  parts = []
  for path in text.stdlib_files():
    if text.is_test_file(path) == test:
      with open(path, "rb") as f:
        parts.append(f.read() + bytes([text.SEPARATOR]))
  return np.frombuffer(b"".join(parts), np.uint8)


def test_splits_are_the_stdlib_files_byte_for_byte(data_dir, capfd):
  train = data.load_stdlib_text("train", data_dir)
  # The first use builds it: one line of ours, not TFDS's "Downloading
  # and preparing dataset Unknown size" (nothing is downloaded), on
  # stderr (stdout may be a CLI's JSON).
  out, err = capfd.readouterr()
  assert "nothing is downloaded" in err and "nothing is downloaded" not in out
  assert "Downloading" not in out + err and "Unknown size" not in out + err
  test = data.load_stdlib_text("test", data_dir)
  assert train.dtype == np.uint8
  np.testing.assert_array_equal(train, _expected(test=False))
  np.testing.assert_array_equal(test, _expected(test=True))
  files = text.stdlib_files()
  assert len(files) > 100  # The standard library, not a stand-in.
  held_out = sum(text.is_test_file(f) for f in files)
  assert 0.03 * len(files) < held_out < 0.2 * len(files)
  assert (test == text.SEPARATOR).sum() == held_out


def test_second_load_reuses_prepared_files(data_dir, monkeypatch):
  data.load_stdlib_text("test", data_dir)

  def fail(*args, **kwargs):
    raise AssertionError("rebuilt the dataset")

  monkeypatch.setattr(data.StdlibText, "download_and_prepare", fail)
  first = data.load_stdlib_text("test[:1]", data_dir)
  assert first[-1] == text.SEPARATOR and len(first) > 100
  assert os.path.isdir(os.path.join(data_dir, "stdlib_text"))
