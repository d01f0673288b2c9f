"""Local TFDS datasets: where they live, and building one on first use."""

import os

DEFAULT_DATA_DIR = os.path.join("~", ".cache", "jpipe", "tensorflow_datasets")


def prepared_source(builder_class, split: str, data_dir: str | None):
  """A ``tfds`` data source of ``split``, building the dataset into
  ``data_dir`` (default ``DEFAULT_DATA_DIR``) as array_record files the
  first time (no TensorFlow needed)."""
  data_dir = os.path.expanduser(data_dir or DEFAULT_DATA_DIR)
  builder = builder_class(data_dir=data_dir, file_format="array_record")
  if not os.path.isdir(builder.data_path):
    builder.download_and_prepare()
  return builder.as_data_source(split=split)
