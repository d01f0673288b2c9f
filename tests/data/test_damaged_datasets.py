"""A prepared dataset whose files are damaged on disk (bits flipped,
truncated, metadata overwritten) stops with one line naming its folder
and the fix, when opened or read -- not the record reader's traceback, and
never wrong examples; the fix (delete it) rebuilds it."""

import glob
import json
import os
import shutil

import numpy as np
import pytest

from jpipe import data
from jpipe.train import errors, train_lib
from tests.train.test_train import _config


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """The digits built once; each test damages a copy."""
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  data.load_digits("train", data_dir)
  return data_dir


def _damaged(built, tmp_path, how):
  data_dir = str(tmp_path / "tfds")
  shutil.copytree(built, data_dir)
  folder = os.path.join(data_dir, "sklearn_digits", "1.0.0")
  (train,) = glob.glob(os.path.join(folder, "*-train.array_record*"))
  with open(train, "rb") as f:
    raw = bytearray(f.read())
  if how == "flipped":  # Inside a chunk: its hash no longer matches.
    raw[20000:20100] = bytes(b ^ 0xFF for b in raw[20000:20100])
    with open(train, "wb") as f:
      f.write(raw)
  elif how == "truncated":  # A copy cut short.
    with open(train, "wb") as f:
      f.write(raw[: len(raw) // 3])
  elif how == "lengths":  # Metadata edited: the split 100 records long.
    info_path = os.path.join(folder, "dataset_info.json")
    with open(info_path) as f:
      info = json.load(f)
    (train_info,) = [s for s in info["splits"] if s["name"] == "train"]
    train_info["shardLengths"] = ["100"]
    with open(info_path, "w") as f:
      json.dump(info, f)
  else:  # Metadata overwritten.
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
      f.write("garbage")
  return data_dir, folder


@pytest.mark.parametrize("how", ["flipped", "truncated", "metadata", "lengths"])
def test_damaged_files_name_the_folder_and_the_fix(built, tmp_path, how):
  data_dir, folder = _damaged(built, tmp_path, how)
  with pytest.raises(data.DatasetError) as caught:
    data.load_digits("train", data_dir)
  message = str(caught.value)
  assert f"the dataset in {folder}" in message
  assert f"delete {folder} and run again" in message
  assert "\n" not in message
  shutil.rmtree(folder)  # The fix: rebuilt, equal to the original.
  x, y = data.load_digits("train", data_dir)
  want_x, want_y = data.load_digits("train", built)
  np.testing.assert_array_equal(x, want_x)
  np.testing.assert_array_equal(y, want_y)


def test_the_cli_counts_it_a_users_error(built, tmp_path):
  """``python -m jpipe.train`` prints USER_ERRORS as one line, exit 2."""
  data_dir, _ = _damaged(built, tmp_path, "flipped")
  config = _config(**{"data.data_dir": data_dir, "train.steps": 1})
  with pytest.raises(errors.USER_ERRORS):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert data.DatasetError in errors.USER_ERRORS
