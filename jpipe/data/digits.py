"""The 8x8 handwritten digits shipped in scikit-learn, as a TFDS dataset.

1,797 grey-scale images (UCI "Optical Recognition of Handwritten Digits"),
pixel values 0..16, ten classes. Built once into ``data_dir`` as array_record
files (no TensorFlow needed), then read with ``tfds`` data sources. The split
is fixed: every fifth image is ``test`` (360), the rest ``train`` (1,437).
"""

import numpy as np
import tensorflow_datasets as tfds

from jpipe.data._local_tfds import prepared_source


class SklearnDigits(tfds.core.GeneratorBasedBuilder):
  """scikit-learn's digits: image uint8 [8, 8, 1] in 0..16, label 0..9.

  ``index`` is the image's row in ``sklearn.datasets.load_digits()``. TFDS
  stores examples in a fixed order shuffled by key, the same on every build.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=__doc__,
      features=tfds.features.FeaturesDict(
        {
          "image": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
          "label": tfds.features.ClassLabel(num_classes=10),
          "index": tfds.features.Scalar(dtype=np.int32),  # Row in sklearn.
        }
      ),
      supervised_keys=("image", "label"),
      homepage="https://archive.ics.uci.edu/dataset/80",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # The data ships with scikit-learn: nothing to download.
    return {
      "train": self._generate_examples(test=False),
      "test": self._generate_examples(test=True),
    }

  def _generate_examples(self, test: bool):
    from sklearn import datasets  # Imported here: only needed to build.

    digits = datasets.load_digits()
    for index, (image, label) in enumerate(
      zip(digits.images, digits.target, strict=True)
    ):
      if (index % 5 == 0) == test:
        yield (
          index,
          {
            "image": image.astype(np.uint8)[..., None],
            "label": int(label),
            "index": index,
          },
        )


def load_digits(
  split: str, data_dir: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """One split as arrays, building the dataset on first use.

  Args:
    split: "train" or "test" (TFDS slicing such as "train[:10%]" works too).
    data_dir: TFDS data dir; default ``~/.cache/jpipe/tensorflow_datasets``.

  Returns:
    images float32 [N, 8, 8, 1] scaled to [0, 1], labels int32 [N], in the
    dataset's stored (fixed, shuffled) order.
  """
  source = prepared_source(SklearnDigits, split, data_dir)
  records = [source[i] for i in range(len(source))]
  images = np.stack([r["image"] for r in records]).astype(np.float32) / 16.0
  labels = np.asarray([r["label"] for r in records], np.int32)
  return images, labels
