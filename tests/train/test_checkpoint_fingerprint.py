"""A checkpoint of another run's settings names the fields that differ."""

from jpipe.train.checkpoint import fingerprint_difference


def test_the_differing_fields_are_named_with_both_values():
  """An outside check changed data_parallel.pipelines 1 -> 4 on resume
  and read 'written for another model ... none of its checkpoints is of
  this model' with both whole fingerprints: now the field alone."""
  saved = {"model": "mlp", "optimizer": "sgd"}
  assert (
    fingerprint_difference(saved, {**saved, "pipelines": 4})
    == "config.data_parallel.pipelines: saved 1, now 4"
  )
  assert fingerprint_difference(
    saved, {"model": "gpt", "optimizer": "sgd"}
  ) == ("config.model.name: saved 'mlp', now 'gpt'")
  assert fingerprint_difference("x", saved) == f"saved x, now {saved}"
