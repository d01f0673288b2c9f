"""The embedded digits dataset is real, complete and deterministic."""

import subprocess
import sys

import numpy as np
import pytest
from sklearn import datasets

from jpipe import data


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def test_splits_partition_sklearn_digits(data_dir):
  train_x, train_y = data.load_digits("train", data_dir)
  test_x, test_y = data.load_digits("test", data_dir)
  assert train_x.shape == (1437, 8, 8, 1) and test_x.shape == (360, 8, 8, 1)
  assert train_x.dtype == np.float32 and train_y.dtype == np.int32
  assert 0.0 <= train_x.min() and train_x.max() <= 1.0
  digits = datasets.load_digits()
  # Same images and labels as sklearn's every fifth row, up to order.
  order = np.lexsort(test_x.reshape(360, -1).T)
  expected_x = digits.images[::5].reshape(360, -1) / 16.0
  expected_order = np.lexsort(expected_x.T)
  np.testing.assert_allclose(
    test_x.reshape(360, -1)[order], expected_x[expected_order]
  )
  np.testing.assert_array_equal(
    test_y[order], digits.target[::5][expected_order]
  )
  assert set(np.unique(train_y)) == set(range(10))


def test_second_load_reuses_prepared_files(data_dir, monkeypatch):
  data.load_digits("test", data_dir)

  def fail(*args, **kwargs):
    raise AssertionError("rebuilt the dataset")

  monkeypatch.setattr(data.SklearnDigits, "download_and_prepare", fail)
  images, labels = data.load_digits("test[:10]", data_dir)
  assert images.shape == (10, 8, 8, 1) and labels.shape == (10,)


@pytest.mark.slow
def test_processes_building_at_once_both_get_the_dataset(tmp_path):
  """The first build is locked: two processes that find no dataset (test
  workers on a fresh machine) do not collide on TFDS's final rename."""
  code = (
    "import sys; from jpipe import data; "
    "x, _ = data.load_digits('train', sys.argv[1]); print(len(x))"
  )
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", code, str(tmp_path)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for _ in range(2)
  ]
  for proc in procs:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert out.split()[-1] == "1437"
