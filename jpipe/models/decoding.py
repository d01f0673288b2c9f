"""The decoding steps ``Pipeline.generate`` takes from an encoder-decoder
(``t5_v1``, ``gnmt``): one prefill / step pair over ``model.apply``."""

import functools


# One pair per model: the pipeline compiles its programs per function.
@functools.lru_cache(maxsize=16)
def encoder_decoder_fns(model, with_index: bool):
  """``model``'s ``(prefill_fn, decode_fn)``: ``(params, batch) ->
  (next-token logits float32 [B, vocab], the new cache)``; batch:
  "inputs" int [B, S] (the sources, 0 pads), "tokens" int [B, L] (the
  decoder's input), "index" int [B] (their position, the same for every
  row; passed to the model as ``index=`` only ``with_index``: an LSTM
  carries its position), "cache" (the model's ``empty_cache`` layout).
  The prefill runs the encoder too (``encode=True``)."""

  def step(params, batch, encode):
    position = {"index": batch["index"][0]} if with_index else {}
    logits, cache = model.apply(
      {"params": params},
      batch["inputs"],
      batch["tokens"],
      train=False,
      cache=batch["cache"],
      encode=encode,
      **position,
    )
    return logits[:, -1], cache

  def prefill_fn(params, batch):
    return step(params, batch, True)

  def decode_fn(params, batch):
    return step(params, batch, False)

  return prefill_fn, decode_fn
