"""Tokenizer files the tests make themselves (no download): a
SentencePiece model with T5's special ids and a HuggingFace byte-level
BPE ``tokenizer.json``, both trained on a few standard-library files."""

import os

from jpipe.data import text

VOCAB = 320  # Small: training takes about a second.


def training_texts(count: int = 6) -> list[str]:
  """The first ``count`` standard-library source files' texts."""
  out = []
  for path in text.stdlib_files()[:count]:
    with open(path, encoding="utf-8") as f:
      out.append(f.read())
  return out


def sentencepiece_model(directory) -> str:
  """A SentencePiece unigram model as T5's: pad 0, eos 1, unk 2."""
  import sentencepiece

  corpus = os.path.join(directory, "corpus.txt")
  with open(corpus, "w", encoding="utf-8") as f:
    f.write("\n".join(training_texts()))
  prefix = os.path.join(directory, "spiece")
  sentencepiece.SentencePieceTrainer.train(
    input=corpus,
    model_prefix=prefix,
    vocab_size=VOCAB,
    pad_id=0,
    eos_id=1,
    unk_id=2,
    bos_id=-1,
    minloglevel=2,
  )
  return prefix + ".model"


def huggingface_json(directory) -> str:
  """A byte-level BPE tokenizer.json (GPT-2's kind) ending texts with
  ``<|endoftext|>``."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=VOCAB,
    special_tokens=["<|endoftext|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tokenizer.train_from_iterator(training_texts(), trainer)
  path = os.path.join(directory, "tokenizer.json")
  tokenizer.save(path)
  return path
