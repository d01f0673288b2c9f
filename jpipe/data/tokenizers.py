"""Text to token ids: bytes (the default), a SentencePiece model, or a
HuggingFace ``tokenizer.json``.

The text datasets are byte streams, documents separated by
``text.SEPARATOR`` (0). A tokenizer turns such a stream into a token
stream (``Tokenizer.stream``): each document encoded, documents joined
by the tokenizer's end-of-text id. Bytes are the identity (token = byte,
256 of them), so byte-level runs are unchanged.

``load(path)`` picks by the file: ``*.json`` is a HuggingFace
``tokenizers`` file (what ``tokenizer.save`` and the Hub's
``tokenizer.json`` are), anything else a SentencePiece model (T5's
``spiece.model``).
"""

import os

import numpy as np

from jpipe.data.text import SEPARATOR

# End-of-text tokens a HuggingFace vocabulary may have, by preference.
_END_TOKENS = ("</s>", "<|endoftext|>", "[SEP]", "<eos>", "<|eos|>")
_PAD_TOKENS = ("<pad>", "[PAD]")  # (BERT's WordPiece pads with [PAD] = 0.)


class Tokenizer:
  """Encodes text as token ids.

  Attributes:
    name: what it is, for messages and the checkpoint's fingerprint.
    vocab_size: ids are in [0, vocab_size).
    end_id: the id between documents of a stream.
    pad_id: its padding id, or None if it has none.
  """

  name: str
  vocab_size: int
  end_id: int
  pad_id: int | None

  @property
  def seq2seq_offset(self) -> int:
    """What seq2seq adds to every id so that 0 is padding only: 0 where
    the tokenizer's own pad id is 0 (T5's), else 1."""
    return 0 if self.pad_id == 0 else 1

  def encode(self, text: str) -> list[int]:
    """The ids of ``text`` (no special tokens added)."""
    raise NotImplementedError

  def token_id(self, token: str) -> int | None:
    """The id of a special token such as "[CLS]", or None if the
    vocabulary has none."""
    del token
    return None

  def decode(self, ids) -> str:
    """The text of ``ids``."""
    raise NotImplementedError

  def encode_many(self, texts: list[str]) -> list[list[int]]:
    """``encode`` of each text."""
    return [self.encode(t) for t in texts]

  def stream(self, data: np.ndarray) -> np.ndarray:
    """int32 [M] token stream of a uint8 [N] byte stream of documents
    separated by ``SEPARATOR``: each encoded, followed by ``end_id``."""
    docs = bytes(np.asarray(data, np.uint8)).split(bytes([SEPARATOR]))
    texts = [d.decode("utf-8", errors="replace") for d in docs if d]
    out = []
    for ids in self.encode_many(texts):
      out.extend(ids)
      out.append(self.end_id)
    return np.asarray(out, np.int32)


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes: token = byte; documents end with byte 0."""

  name = "bytes"
  vocab_size = 256
  end_id = SEPARATOR
  pad_id = None

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

  def stream(self, data: np.ndarray) -> np.ndarray:
    return np.asarray(data)  # Already one: the identity.


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model file (``*.model``: T5's ``spiece.model``)."""

  def __init__(self, path: str):
    import sentencepiece  # Only where one is named.

    self.name = f"sentencepiece:{os.path.abspath(path)}"
    self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    self.vocab_size = self._sp.get_piece_size()
    eos, pad = self._sp.eos_id(), self._sp.pad_id()
    self.end_id = eos if eos >= 0 else 0
    self.pad_id = pad if pad >= 0 else None

  def encode(self, text: str) -> list[int]:
    return list(self._sp.encode(text))

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in ids])


class HuggingFaceTokenizer(Tokenizer):
  """A HuggingFace ``tokenizers`` file (``tokenizer.json``)."""

  def __init__(self, path: str):
    import tokenizers  # Only where one is named.

    self.name = f"huggingface:{os.path.abspath(path)}"
    self._tok = tokenizers.Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    ids = [self._tok.token_to_id(t) for t in _END_TOKENS]
    found = [i for i in ids if i is not None]
    self.end_id = found[0] if found else 0
    padding = self._tok.padding
    pads = [self._tok.token_to_id(t) for t in _PAD_TOKENS]
    pad = next((i for i in pads if i is not None), None)
    self.pad_id = padding["pad_id"] if padding else pad

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def token_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def encode_many(self, texts: list[str]) -> list[list[int]]:
    batch = self._tok.encode_batch(texts, add_special_tokens=False)
    return [e.ids for e in batch]  # (Encoded in parallel by the library.)

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids])


def load(path: str) -> Tokenizer:
  """The tokenizer ``path`` names ("" or "bytes": bytes). ValueError,
  naming the path, where it is missing or unreadable."""
  if path in ("", "bytes"):
    return ByteTokenizer()
  if not os.path.isfile(path):
    raise ValueError(
      f"no tokenizer file {path!r}: give a SentencePiece model (*.model) "
      "or a HuggingFace tokenizer.json, or '' for bytes"
    )
  kind = (
    HuggingFaceTokenizer if path.endswith(".json") else (SentencePieceTokenizer)
  )
  try:
    return kind(path)
  except Exception as e:  # Each library raises its own kinds.
    what = (
      "HuggingFace tokenizer.json"
      if path.endswith(".json")
      else ("SentencePiece model")
    )
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise ValueError(
      f"{path!r} is not a readable {what} ({type(e).__name__}: {first})"
    ) from e
