"""The CLI's data sources beyond TFDS: text files by pattern; the
configured image shape checked against the images."""

import numpy as np
import pytest

from configs import default as default_config
from jpipe.train import base_config, input_pipeline
from jpipe.train.errors import UsageError


def test_text_files_are_read_in_sorted_order(tmp_path):
  """Sorted by name; a file not ending in a newline gets one before the
  next file (its last word and the next file's first stayed joined)."""
  (tmp_path / "c.raw").write_bytes(b"third")
  (tmp_path / "b.raw").write_bytes(b"second\n")
  (tmp_path / "a.raw").write_bytes("first é".encode())
  (tmp_path / "valid.txt").write_bytes(b"held out")
  config = base_config.base_config()
  config.data = base_config.text_data("text_files")
  config.data.train_split = str(tmp_path / "*.raw")
  config.data.eval_split = str(tmp_path / "valid.txt")
  train, test = input_pipeline.load_text(config)
  assert train.dtype == np.uint8
  assert train.tobytes() == "first é\nsecond\nthird".encode()
  assert test.tobytes() == b"held out"
  config.data.eval_split = str(tmp_path / "missing*.txt")
  with pytest.raises(UsageError, match=r"eval_split=.*no file matches"):
    input_pipeline.load_text(config)


def test_image_shape_is_checked_against_the_images():
  config = default_config.get_config()
  train, _ = input_pipeline.load_images(config)
  assert train.images.shape[1:] == (8, 8, 1)
  config.data.image_shape = (8, 8, 1)
  input_pipeline.load_images(config)  # The digits' own shape: fine.
  config.data.image_shape = (32, 32, 3)
  with pytest.raises(UsageError, match=r"images are \(8, 8, 1\)"):
    input_pipeline.load_images(config)


def _imagenet_config(shape=(16, 16, 3)):
  config = base_config.base_config()
  config.data = base_config.image_data("imagenet2012")
  config.data.eval_split = "validation"
  config.data.image_shape = shape
  config.data.batch_size = 4
  return config


def test_imagenet_sized_images_are_streamed_resized_and_augmented():
  """A dataset whose images vary in size (TFDS mock records of ImageNet's
  features) is read per batch: training crops at random and flips, the
  same step gives the same batch; evaluation centre-crops."""
  import tensorflow_datasets as tfds

  config = _imagenet_config()
  with tfds.testing.mock_data(num_examples=12):
    train, test = input_pipeline.load_images(config)
    assert isinstance(train, input_pipeline.StreamedImages)
    assert len(train) == 12
    one = input_pipeline.image_batch_at(train, 3, 4, 0)
    two = input_pipeline.image_batch_at(train, 3, 4, 0)
    other = input_pipeline.image_batch_at(train, 4, 4, 0)
    assert one["x"].shape == (4, 16, 16, 3) and one["x"].dtype == np.float32
    assert 0.0 <= one["x"].min() and one["x"].max() <= 1.0
    np.testing.assert_array_equal(one["x"], two["x"])
    assert not np.array_equal(one["x"], other["x"])
    batches = list(input_pipeline.streamed_eval_batches(test, 5, 7))
    assert [b["weight"].tolist() for b in batches] == [[1] * 5, [1, 1, 0, 0, 0]]
    again = list(input_pipeline.streamed_eval_batches(test, 5, 7))
    np.testing.assert_array_equal(batches[0]["x"], again[0]["x"])


def test_evaluation_crop_of_a_constant_image_is_constant():
  images = object.__new__(input_pipeline.StreamedImages)
  images.shape = (8, 8, 3)
  flat = np.full((30, 50, 3), 128, np.uint8)
  out = images._prepare(flat, None)
  assert out.shape == (8, 8, 3)
  np.testing.assert_allclose(out, 128 / 255, rtol=1e-6)
  rng = np.random.default_rng(0)
  crop = input_pipeline._random_crop(30, 50, rng)
  left, top, right, bottom = crop
  assert 0 <= left < right <= 50 and 0 <= top < bottom <= 30
  area = (right - left) * (bottom - top)
  assert 0.08 * 1500 - 1e-6 <= area <= 1500 + 1e-6
