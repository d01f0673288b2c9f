"""Stand-in data of a config's shapes: planning without the dataset.

``python -m jpipe.train.plan`` splits a model it never runs: the trace
needs the batch's shapes and dtypes, not its values. These functions give
a batch of the config's shapes (``config.data.batch_size``, its sequence
lengths, its image shape) through the same batching code as training,
from constant values, so a seed's full-size config plans on a machine
that has neither its dataset nor its tokenizer. Nothing here is trained
on: ``build_task(config, abstract=True)`` is the only caller.
"""

import os

import numpy as np

from jpipe.data import tokenizers
from jpipe.train import input_pipeline
from jpipe.train.errors import UsageError

DIGITS_SHAPE = (8, 8, 1)


def image_shape(config) -> tuple[int, ...]:
  """[H, W, C] of ``config.data``'s images: ``data.image_shape`` if set,
  else the dataset's (the embedded digits', or a TFDS dataset's static
  feature shape, read from its metadata: nothing is downloaded)."""
  data = config.data
  if data.get("image_shape"):
    return tuple(int(d) for d in data.image_shape)
  if data.name == "digits":
    return DIGITS_SHAPE
  shape = input_pipeline.feature_shape(config, data.image_key)
  if shape is None or None in shape:
    raise UsageError(
      f"config.data ({data.name}): its images have no fixed shape "
      f"({shape}); set config.data.image_shape, e.g. (224, 224, 3)"
    )
  return tuple(shape)


def images(config) -> tuple[input_pipeline.ArrayData, input_pipeline.ArrayData]:
  """(train, eval) of one batch each: zero images of ``image_shape``."""
  n = config.data.batch_size
  zeros = np.zeros((n, *image_shape(config)), np.float32)
  data = input_pipeline.ArrayData(zeros, np.zeros(n, np.int32))
  return data, data


def tokenizer(config) -> tokenizers.Tokenizer:
  """``config.data.tokenizer`` where the file is here; else the byte
  tokenizer (a batch's shapes do not depend on its ids)."""
  path = config.data.get("tokenizer", "")
  if path and os.path.exists(path):
    return input_pipeline.tokenizer(config)
  return tokenizers.load("")


def token_streams(config) -> tuple[np.ndarray, np.ndarray]:
  """(train, eval) streams of token ids, long enough for one batch of
  ``config.data.sequence_length`` windows (and the held-out windows)."""
  data = config.data
  windows = data.batch_size + max(data.get("eval_sequences", 0), 1)
  n = (windows + 1) * (data.sequence_length + 1)
  stream = np.ones(n, np.int32)
  return stream, stream


def records(config) -> list[dict]:
  """One batch of text-task records with every feature the config names
  (text "a", label 0, one answer at 0)."""
  data = config.data
  text = b"a"
  record = {}
  for name in str(data.get("text_keys", "")).split(","):
    if name.strip():
      record[name.strip()] = text
  for key in ("question_key", "context_key", "source_key", "target_key"):
    if data.get(key):
      record[data[key]] = text
  if data.get("label_key"):
    record[data.label_key] = 0
  if data.get("answers_key"):
    record[data.answers_key] = {
      "text": np.asarray([text]),
      "answer_start": np.asarray([0]),
    }
  return [dict(record) for _ in range(data.batch_size)]
