"""Training and evaluation data: embedded or the user's TFDS datasets.

Data is read once into host memory (the sizes these configs use: digits,
CIFAR, a few MB of text) through ``tfds`` data sources -- array_record
files, no TensorFlow. Batches are a pure function of (seed, step), so the
data position of a resumed run is just its step.
"""

import codecs
import difflib
import functools
import glob
import importlib
import os
from typing import NamedTuple

import numpy as np
import tensorflow_datasets as tfds

from jpipe.data import (
  CheckedSource,
  digits,
  prepared_source,
  split_names,
  stdlib_tasks,
  text,
  tokenizers,
)
from jpipe.train.errors import UsageError


class ArrayData(NamedTuple):
  """Images float32 [N, H, W, C] in [0, 1]; labels int32 [N]."""

  images: np.ndarray
  labels: np.ndarray


def load_images(config) -> tuple[ArrayData, ArrayData]:
  """(train, eval) image splits named by ``config.data``."""
  data = config.data
  check_splits(data)
  if data.name == "digits":
    train = digits.load_digits(data.train_split, data.data_dir or None)
    test = digits.load_digits(data.eval_split, data.data_dir or None)
    splits = ArrayData(*train), ArrayData(*test)
  elif _streams_images(config):
    return (
      StreamedImages(data, data.train_split),
      StreamedImages(data, data.eval_split),
    )
  else:
    splits = (
      _tfds_arrays(data, data.train_split),
      _tfds_arrays(data, data.eval_split),
    )
  for key, arrays in zip(("train_split", "eval_split"), splits, strict=True):
    check_examples(len(arrays.labels), data, key)
    check_labels(arrays.labels, f"config.data ({data.name}, {data[key]})")
  want = tuple(data.get("image_shape") or ())
  have = splits[0].images.shape[1:]
  if want and tuple(want) != have:
    raise UsageError(
      f"config.data.image_shape={want}, but {data.name}'s images are "
      f"{have}: the embedded digits are not resized; set image_shape to "
      f"{have} or () (a TFDS dataset's images are resized to it)"
    )
  return splits


def check_labels(labels: np.ndarray, where: str) -> None:
  """A UsageError where an image label is negative: TFDS's "no label"
  (-1, e.g. an unlabelled test split) would train as the last class and
  score as a miss."""
  bad = labels[labels < 0]
  if bad.size:
    raise UsageError(
      f"{where}: {bad.size} of {labels.size} labels are {int(bad[0])}, not "
      "a class (TFDS marks unlabelled examples -1, e.g. a test split that "
      "hides its labels): train and evaluate on labelled splits "
      "(config.data.train_split / eval_split)"
    )


def _streams_images(config) -> bool:
  """Whether a TFDS dataset's images are read per batch, resized: where
  ``data.image_shape`` is set and differs from the dataset's (ImageNet's
  images vary in size; nor would they fit in memory)."""
  want = tuple(config.data.get("image_shape") or ())
  return bool(want) and feature_shape(config, config.data.image_key) != want


class StreamedImages:
  """A TFDS split's images read when a batch asks for them, each record
  decoded and brought to ``data.image_shape`` [H, W, C] as ResNet's
  ImageNet recipe does (Szegedy et al.; torchvision's): training, a
  random crop of 8-100 % of the area at aspect ratio 3/4-4/3, resized,
  flipped left-right half the time, drawn from (seed, step, example);
  evaluation, the shorter side resized to H / 0.875 and the centre H x W
  cropped. Pixels in [0, 1]. ``len`` is the split's size."""

  def __init__(self, data, split: str):
    self._source = _tfds_source(data, split, embedded="digits")
    self._image_key, self._label_key = data.image_key, data.label_key
    self._name = f"{data.name}, {split}"
    self.shape = tuple(int(d) for d in data.image_shape)

  def __len__(self) -> int:
    return len(self._source)

  def batch(self, take, rng=None) -> tuple[np.ndarray, np.ndarray]:
    """(images float32 [n, H, W, C], labels int32 [n]) of records
    ``take``; ``rng`` (a numpy Generator): training augmentation, None:
    evaluation's centre crop."""
    images, labels = [], []
    for i in np.asarray(take):
      record = self._source[int(i)]
      images.append(self._prepare(np.asarray(record[self._image_key]), rng))
      labels.append(int(record[self._label_key]))
    labels = np.asarray(labels, np.int32)
    check_labels(labels, f"config.data ({self._name})")
    return np.stack(images), labels

  def _prepare(self, image, rng) -> np.ndarray:
    from PIL import Image  # Only for streamed datasets.

    height, width, channels = self.shape
    if image.ndim == 2:
      image = image[..., None]
    if image.shape[-1] != channels:
      raise UsageError(
        f"config.data.image_shape={self.shape}: the dataset's images have "
        f"{image.shape[-1]} channels"
      )
    h, w = image.shape[:2]
    if rng is None:  # Resize the shorter side, crop the centre.
      scale = max(height, width) / 0.875 / min(h, w)
      size = (max(width, round(w * scale)), max(height, round(h * scale)))
      top, left = (size[1] - height) // 2, (size[0] - width) // 2
      box = (
        left / scale,
        top / scale,
        (left + width) / scale,
        (top + height) / scale,
      )
    else:
      box = _random_crop(h, w, rng)
    planes = []
    for c in range(channels):  # (PIL resizes one plane of any dtype.)
      plane = Image.fromarray(np.ascontiguousarray(image[..., c]))
      plane = plane.resize((width, height), Image.BILINEAR, box=box)
      planes.append(np.asarray(plane, np.float32))
    out = np.stack(planes, -1)
    if rng is not None and rng.random() < 0.5:
      out = out[:, ::-1]
    scale = 255.0 if image.dtype == np.uint8 else 1.0
    return out / scale


def _random_crop(h, w, rng) -> tuple[float, float, float, float]:
  """(left, top, right, bottom) of an Inception-style random crop: 8-100 %
  of the area, aspect ratio 3/4-4/3 (log-uniform), 10 tries, then the
  centre square."""
  area = h * w
  for _ in range(10):
    target = area * rng.uniform(0.08, 1.0)
    ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    cw, ch = np.sqrt(target * ratio), np.sqrt(target / ratio)
    if cw <= w and ch <= h:
      left, top = rng.uniform(0, w - cw), rng.uniform(0, h - ch)
      return (left, top, left + cw, top + ch)
  side = min(h, w)
  left, top = (w - side) / 2, (h - side) / 2
  return (left, top, left + side, top + side)


def streamed_eval_batches(
  images: "StreamedImages", batch_size: int, count: int
):
  """The first ``count`` (0: all) evaluation images in batches of
  ``batch_size`` with a "weight" leaf (0 on the last batch's padding),
  read as each batch is asked for."""
  n = min(len(images), count or len(images))
  for start in range(0, n, batch_size):
    rows = np.arange(start, start + batch_size)
    real = rows < n
    x, y = images.batch(np.where(real, rows, start))
    yield {"x": x, "y": y, "weight": real.astype(np.float32)}


def feature_shape(config, key: str) -> tuple | None:
  """The static shape TFDS's metadata gives ``config.data``'s feature
  ``key`` (None in a dimension that varies; None if it has none); read
  without the dataset's files."""
  return getattr(feature(config, key), "shape", None)


def feature(config, key: str):
  """TFDS's metadata of ``config.data``'s feature ``key`` (read without
  the dataset's files); a UsageError where it has no such feature."""
  features = _tfds_builder(config.data).info.features
  if key not in features:
    raise UsageError(
      f"config.data ({config.data.name}) has no feature {key!r}; it has "
      f"{sorted(features)}"
    )
  return features[key]


TEXT_FILES = "text_files"  # config.data.name: splits are file patterns.


def load_text(config) -> tuple[np.ndarray, np.ndarray]:
  """(train, eval) byte streams, uint8 [N]: "stdlib_text" (embedded),
  "text_files" (the splits are paths or glob patterns of UTF-8 text
  files, e.g. WikiText's wiki.train.raw; the files of a split are read
  in sorted order) or a TFDS dataset whose ``config.data.text_key``
  feature holds the text."""
  data = config.data
  if data.name == TEXT_FILES:
    return _text_files(data, "train_split"), _text_files(data, "eval_split")
  check_splits(data)
  if data.name == "stdlib_text":
    return (
      text.load_stdlib_text(data.train_split, data.data_dir or None),
      text.load_stdlib_text(data.eval_split, data.data_dir or None),
    )
  streams = []
  for split in (data.train_split, data.eval_split):
    source = _tfds_source(data, split, embedded="stdlib_text")
    streams.append(
      text.concatenate_texts(
        source[i][data.text_key] for i in range(len(source))
      )
    )
  return streams[0], streams[1]


def _text_files(data, key: str) -> np.ndarray:
  """The bytes of the files ``data[key]`` names (a path or glob pattern),
  in sorted order, a newline between two files where the first has none
  at its end (their last and first words stay apart)."""
  files = sorted(glob.glob(data[key]))
  if not files:
    raise UsageError(
      f"config.data.{key}={data[key]!r}: no file matches (with "
      f"config.data.name={TEXT_FILES!r} the splits are text files' paths "
      "or glob patterns, e.g. /data/wikitext-2-raw/wiki.train.raw)"
    )
  chunks = [_text_file(f"config.data.{key}", path) for path in files]
  chunks = [
    c if c.endswith(b"\n") or i == len(chunks) - 1 else c + b"\n"
    for i, c in enumerate(chunks)
  ]
  return np.frombuffer(b"".join(chunks), np.uint8)


_BLOCK = 1 << 24  # Bytes decoded at a time (a large file's memory bounded).


def _text_file(key: str, path: str) -> bytes:
  """The bytes of one text file; a UsageError naming it (``key``: the
  config key that names it) where it is a directory, empty or not UTF-8
  (a binary or compressed file would train on its bytes unnoticed)."""
  if os.path.isdir(path):
    raise UsageError(
      f"{key}: {path} is a directory; name the text files in it, e.g. "
      f"{os.path.join(path, '*.txt')}"
    )
  with open(path, "rb") as f:
    data = f.read()
  if not data:
    raise UsageError(
      f"{key}: {path} is empty (0 bytes); name a file of text (or remove "
      "it from the pattern)"
    )
  decoder = codecs.getincrementaldecoder("utf-8")()
  for start in range(0, len(data), _BLOCK):
    try:
      decoder.decode(data[start : start + _BLOCK], start + _BLOCK >= len(data))
    except UnicodeDecodeError as e:
      at = start + e.start - len(decoder.getstate()[0])
      raise UsageError(
        f"{key}: {path} is not UTF-8 text (byte {at} of {len(data)}: "
        f"{data[at : at + 4]!r}); text files are read as UTF-8: convert it "
        "(iconv -t UTF-8) or name the text file, not a binary or "
        "compressed one"
      ) from None
  return data


def tokenizer(config) -> tokenizers.Tokenizer:
  """``config.data.tokenizer``'s tokenizer: bytes (""), a SentencePiece
  model or a HuggingFace tokenizer.json by path; a UsageError naming
  the key where it cannot be read."""
  path = config.data.get("tokenizer", "")
  try:
    return tokenizers.load(path)
  except ValueError as e:
    raise UsageError(f"config.data.tokenizer: {e}") from e


def load_tokens(config, tokens: tokenizers.Tokenizer, need: int = 1):
  """(train, eval) token streams of the config's text (``load_text``)
  as ``tokens`` encodes them (bytes: uint8, unchanged); each at least
  ``need`` tokens long (one sequence), else a UsageError naming the
  split, its size and the fix."""
  texts = load_text(config)
  streams = tokens.stream(texts[0]), tokens.stream(texts[1])
  keys = ("train_split", "eval_split")
  for key, data, stream in zip(keys, texts, streams, strict=True):
    if len(stream) < need:
      raise UsageError(
        f"config.data.{key}={config.data[key]!r} holds {len(data)} bytes, "
        f"{len(stream)} tokens ({tokens.name}): fewer than the {need} of "
        f"one sequence at config.data.sequence_length="
        f"{config.data.sequence_length}; give more text or lower "
        "config.data.sequence_length"
      )
  return streams


# Built from files on this machine (the text tasks': stdlib_tasks.BUILDERS).
EMBEDDED = ("digits", "stdlib_text", *stdlib_tasks.BUILDERS)


def check_splits(data) -> None:
  """Before any data is read: the dataset exists (a TFDS name, or an
  embedded one) and has the training and evaluation splits; a UsageError
  naming the config key otherwise."""
  for key in ("train_split", "eval_split"):
    try:
      tfds.core.ReadInstruction.from_spec(data[key])
    except ValueError as e:  # TFDS's first line only points at its docs.
      why = str(e).strip().splitlines()[-1].split(". See format")[0]
      raise UsageError(
        f"config.data.{key}={data[key]!r} is not a split: {why}. Write a "
        f"split name with an optional slice, e.g. 'train', 'train[:50%]', "
        f"'train[100:200]' or 'train[:80%]+test'"
      ) from None
  if data.name in EMBEDDED:
    splits = ("train", "test")  # Both embedded datasets split this way.
    info = None
  else:
    info = _tfds_builder(data).info
    splits = tuple(info.splits.keys())
  if not splits:  # Not prepared yet: reading it says how to.
    return
  for key in ("eval_split", "train_split"):
    for name in split_names(data[key]):
      if name not in splits:
        raise UsageError(
          f"config.data.{key}={data[key]!r}: dataset {data.name!r} has no "
          f"split {name!r}; it has {list(splits)} (TFDS slicing such as "
          f"'{splits[-1]}[:50%]' works too)"
        )
    if info is not None and not info.splits[data[key]].num_examples:
      check_examples(0, data, key)


def check_examples(count: int, data, key: str) -> None:
  """A UsageError where ``config.data[key]`` (a split) selects no
  examples (``count``)."""
  if not count:
    raise UsageError(
      f"config.data.{key}={data[key]!r} selects no examples of "
      f"{data.name!r}: widen its slice"
    )


def _tfds_builder(data):
  """``tfds.builder`` of ``config.data``, or a short UsageError for a name
  TFDS does not know (its own lists every dataset it has) or a data_dir
  that does not exist."""
  if data.data_dir and not os.path.isdir(data.data_dir):
    raise UsageError(
      f"config.data.data_dir={data.data_dir!r} does not exist. "
      f"{_preparing(data)}."
    )
  try:
    return tfds.builder(data.name, data_dir=data.data_dir or None)
  except tfds.core.registered.DatasetNotFoundError as e:
    if _register_text_builders():  # GLUE, WMT, ... now known: retry.
      return _tfds_builder(data)
    there = sorted(os.listdir(data.data_dir)) if data.data_dir else []
    known = there + list(EMBEDDED)
    known += tfds.list_builders(with_community_datasets=False)
    close = difflib.get_close_matches(data.name, known, n=3)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    if there:
      hint += f" (data_dir holds {there})"
    raise UsageError(
      f"config.data.name={data.name!r}: no such dataset, neither embedded "
      f"({', '.join(EMBEDDED)}) nor in TFDS{hint} (the TFDS catalogue: "
      f"https://www.tensorflow.org/datasets/catalog)"
    ) from e


# TFDS families whose builders register only once imported (TFDS imports
# them lazily): GLUE, SuperGLUE, WMT and their kin.
_LAZY_FAMILIES = ("text", "translate", "question_answering")


_registered = []  # Whether _register_text_builders ran: [True] or [].


def _register_text_builders() -> bool:
  """Imports the lazily imported TFDS families; True the first time
  only, when a name not found before may now be found."""
  if _registered:
    return False
  for family in _LAZY_FAMILIES:
    importlib.import_module(f"tensorflow_datasets.{family}")
  _registered.append(True)
  return True


def _preparing(data) -> str:
  """How to prepare ``config.data``'s TFDS dataset, offline use."""
  return (
    f"Prepare it where there is internet (`tfds build {data.name} "
    f"--data_dir DIR --file_format array_record`) and set "
    f"config.data.data_dir=DIR"
  )


def _tfds_source(data, split: str, embedded: str | None):
  """``tfds.data_source`` or a UsageError saying how to prepare the data
  (``embedded``: the embedded dataset of the same kind, if any)."""
  fix = _preparing(data)
  if embedded:
    fix += f", or use config.data.name='{embedded}' (embedded)"
  _tfds_builder(data)  # (Its data_dir exists; a name TFDS registers late
  # is registered now.)
  try:
    # download=False: a missing dataset would otherwise make TFDS try (and,
    # offline, slowly fail) to download it.
    source = tfds.data_source(
      data.name, split=split, data_dir=data.data_dir or None, download=False
    )
  except Exception as e:  # TFDS raises several types for a missing dataset.
    raise UsageError(
      f"TFDS dataset {data.name!r} (split {split!r}) is not available in "
      f"data_dir {data.data_dir or '(default)'!r}: {e}. {fix}."
    ) from e
  where = f"data_dir {data.data_dir or '(default)'!r} ({data.name})"
  return CheckedSource(source, where, f"prepare it again. {fix}")


def _tfds_arrays(data, split: str) -> ArrayData:
  source = _tfds_source(data, split, embedded="digits")
  records = [source[i] for i in range(len(source))]
  for key in ("image_key", "label_key"):
    if records and data[key] not in records[0]:
      raise UsageError(
        f"config.data.{key}={data[key]!r}: {data.name}'s examples have "
        f"no such feature; they have {sorted(records[0])}"
      )
  images = np.stack([r[data.image_key] for r in records])
  scale = 255.0 if images.dtype == np.uint8 else 1.0
  labels = np.asarray([r[data.label_key] for r in records], np.int32)
  return ArrayData(images.astype(np.float32) / scale, labels)


def image_batch_at(
  data: ArrayData, step: int, batch_size: int, seed: int
) -> dict:
  """The training batch of ``step``: epoch-wise shuffles seeded by
  (seed, epoch); the last partial batch of an epoch is dropped."""
  size = len(data) if isinstance(data, StreamedImages) else len(data.labels)
  per_epoch = size // batch_size
  if per_epoch == 0:
    raise UsageError(
      f"data.batch_size={batch_size} is larger than the training set "
      f"({size} examples)"
    )
  epoch, index = divmod(step, per_epoch)
  order = np.random.default_rng([seed, epoch]).permutation(size)
  take = order[index * batch_size : (index + 1) * batch_size]
  if isinstance(data, StreamedImages):  # Augmented from (seed, step).
    x, y = data.batch(take, np.random.default_rng([seed, step, 2]))
    return {"x": x, "y": y}
  return {"x": data.images[take], "y": data.labels[take]}


def records(config, split: str):
  """The examples of a TFDS ``split`` of ``config.data``: a random-access
  sequence of dicts (a ``tfds`` data source; nothing is read until
  indexed), or a UsageError saying how to prepare the dataset. An
  embedded task (``stdlib_tasks``) is built on first use."""
  builder = stdlib_tasks.BUILDERS.get(config.data.name)
  if builder is not None:
    return prepared_source(builder, split, config.data.data_dir or None)
  # The embedded task of the same format (none for classification).
  embedded = {"qa": "stdlib_qa", "translation": "stdlib_translation"}
  return _tfds_source(
    config.data, split, embedded=embedded.get(config.data.format)
  )


def class_names(config, key: str) -> list[str]:
  """The class names of ``config.data``'s ``key`` feature (a TFDS
  ClassLabel); a UsageError if it is not one."""
  features = _tfds_builder(config.data).info.features
  if key not in features:
    raise UsageError(
      f"config.data.label_key={key!r}: {config.data.name!r} has no such "
      f"feature; it has {sorted(features)}"
    )
  feature = features[key]
  names = getattr(feature, "names", None)
  if not names:
    raise UsageError(
      f"config.data.label_key={key!r}: {config.data.name!r}'s feature is "
      f"{feature!r}, not a ClassLabel (integer classes with names); text "
      "classification needs one"
    )
  return list(names)


def record_batch_at(source, step: int, batch_size: int, seed: int) -> list:
  """The ``step``-th training batch of ``source``'s records: epoch-wise
  shuffles seeded by (seed, epoch), the last partial batch of an epoch
  dropped (as ``image_batch_at``)."""
  per_epoch = len(source) // batch_size
  if per_epoch == 0:
    raise UsageError(
      f"data.batch_size={batch_size} is larger than the training set "
      f"({len(source)} examples)"
    )
  epoch, index = divmod(step, per_epoch)
  order = _epoch_order(len(source), seed, epoch)
  return [source[int(i)] for i in order[index * batch_size :][:batch_size]]


@functools.lru_cache(maxsize=2)
def _epoch_order(size: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(size)


def as_text(value) -> str:
  """A TFDS Text feature's value as str (data sources give str or
  UTF-8 bytes)."""
  if isinstance(value, bytes):
    return value.decode("utf-8")
  return str(value)
