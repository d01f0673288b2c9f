"""The GPT delay-correction study's variants and table (its runs are
the pipeline's own, tested elsewhere; a full run takes an hour)."""

import pytest

from experiments.staleness import gpt_pipeline


@pytest.mark.parametrize(
  "variant", ["1f1b", "stale", "wp", "ws", "ws+pm", "ws+dnag", "ws+nag99"]
)
def test_each_variant_is_a_checked_config(variant):
  config = gpt_pipeline.variant_config(variant, 4, 20, 8)
  assert config.pipeline.num_stages == 4
  assert config.model.kwargs.num_layers == 8
  st = config.staleness
  if variant == "1f1b":
    assert config.schedule.name == "1f1b" and not st.prediction
    return
  assert config.schedule.name == "async"
  assert st.stashing == variant.startswith("ws")
  assert config.pipeline.recompute == (not st.stashing)
  assert (st.prediction == "msnag") == (variant == "wp")
  assert (st.pipemare_anneal_steps == -1) == ("pm" in variant)
  assert st.delay_nesterov == {"ws+dnag": "adaptive", "ws+nag99": "fixed"}.get(
    variant, ""
  )


def test_table_compares_with_1f1b_at_the_same_depth():
  rows = [
    dict(variant=v, num_stages=p, perplexity=ppl, mean_train_loss=loss)
    for v, p, ppl, loss in [
      ("1f1b", 4, 10.0, 2.0),
      ("stale", 4, 12.0, 3.0),
      ("1f1b", 8, 20.0, 4.0),
      ("stale", 8, 10.0, 2.0),
    ]
  ]
  text = gpt_pipeline.table(rows)
  assert "| 4 | stale | 12.000 | 1.200 | 3.000 | 1.500 |" in text
  assert "| 8 | stale | 10.000 | 0.500 | 2.000 | 0.500 |" in text
