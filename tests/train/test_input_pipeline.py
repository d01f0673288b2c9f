"""The CLI's data sources beyond TFDS: text files by pattern; the
configured image shape checked against the images."""

import numpy as np
import pytest

from configs import default as default_config
from jpipe.train import base_config, input_pipeline
from jpipe.train.errors import UsageError


def test_text_files_are_read_in_sorted_order(tmp_path):
  (tmp_path / "b.raw").write_bytes(b"second ")
  (tmp_path / "a.raw").write_bytes("first é ".encode())
  (tmp_path / "valid.txt").write_bytes(b"held out")
  config = base_config.base_config()
  config.data = base_config.text_data("text_files")
  config.data.train_split = str(tmp_path / "*.raw")
  config.data.eval_split = str(tmp_path / "valid.txt")
  train, test = input_pipeline.load_text(config)
  assert train.dtype == np.uint8
  assert train.tobytes() == "first é second ".encode()
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
