"""The Flax examples' own models, as they ship (Apache 2.0, The Flax
Authors): ``examples/<name>/models.py`` of github.com/google/flax at
commit 18f8f311c275d57f46d95e41b15aa97b454754c0, copied unchanged as
``<name>_models.py`` (ruff leaves them as they are). jpipe is checked
against code nobody here wrote: ``test_flax_examples.py`` trains each
through the stages and decodes lm1b's language model."""
