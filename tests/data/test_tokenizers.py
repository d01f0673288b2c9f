"""Tokenizers by path: bytes, a SentencePiece model, a HuggingFace
tokenizer.json -- each against its own library called directly."""

import numpy as np
import pytest

from jpipe.data import text, tokenizers
from tests.data import tokenizer_files

SAMPLE = "def f(x):\n    return x + 1  # héllo\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  directory = tmp_path_factory.mktemp("tokenizers")
  return {
    "sentencepiece": tokenizer_files.sentencepiece_model(str(directory)),
    "huggingface": tokenizer_files.huggingface_json(str(directory)),
  }


def _reference_ids(kind, path, sample):
  """The library's own encoding, called directly."""
  if kind == "sentencepiece":
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=path).encode(sample)
  import tokenizers as hf

  return hf.Tokenizer.from_file(path).encode(sample).ids


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface"])
def test_a_tokenizer_file_encodes_as_its_library(files, kind):
  tok = tokenizers.load(files[kind])
  ids = tok.encode(SAMPLE)
  assert ids == list(_reference_ids(kind, files[kind], SAMPLE))
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.vocab_size == tokenizer_files.VOCAB
  if kind == "huggingface":  # Byte-level BPE gives the text back.
    assert tok.decode(ids) == SAMPLE
  else:  # SentencePiece normalises whitespace (T5's loses newlines).
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=files[kind])
    assert tok.decode(ids) == sp.decode(ids)


def test_special_ids_are_read_from_the_files(files):
  sp = tokenizers.load(files["sentencepiece"])
  assert (sp.pad_id, sp.end_id, sp.seq2seq_offset) == (0, 1, 0)  # T5's.
  hf = tokenizers.load(files["huggingface"])
  assert hf.end_id == 0  # <|endoftext|>, the first special token.
  assert hf.pad_id is None and hf.seq2seq_offset == 1


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface"])
def test_a_stream_is_each_document_then_the_end_id(files, kind):
  """Documents separated by byte 0 -> each encoded, then end_id: the
  property checked against encoding each document alone."""
  tok = tokenizers.load(files[kind])
  docs = ["first document\n", "zweites Dokument: ü\n", "3"]
  stream = text.concatenate_texts(docs)
  want = []
  for doc in docs:
    want += tok.encode(doc) + [tok.end_id]
  np.testing.assert_array_equal(tok.stream(stream), want)
  assert tok.stream(stream).dtype == np.int32


def test_bytes_are_the_identity():
  tok = tokenizers.load("")
  stream = text.concatenate_texts(["ab", "c"])
  assert tok.stream(stream) is not None
  np.testing.assert_array_equal(tok.stream(stream), stream)
  assert (
    tok.encode("é") == list("é".encode()) and tok.decode([104, 105]) == "hi"
  )
  assert tok.seq2seq_offset == 1  # Byte 0 is a token: ids shift by 1.


def test_missing_or_unreadable_files_name_the_fix(tmp_path):
  with pytest.raises(ValueError, match="no tokenizer file"):
    tokenizers.load(str(tmp_path / "nope.model"))
  garbage = tmp_path / "garbage.json"
  garbage.write_text("not json")
  with pytest.raises(ValueError, match="not a readable HuggingFace"):
    tokenizers.load(str(garbage))
  garbage = tmp_path / "garbage.model"
  garbage.write_bytes(b"\x00\x01")
  with pytest.raises(ValueError, match="not a readable SentencePiece"):
    tokenizers.load(str(garbage))
