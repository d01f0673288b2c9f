"""Datasets as local TFDS builders over data that ships with packages."""

from jpipe.data._local_tfds import (
  CheckedSource,
  DatasetError,
  open_checked,
  prepared_source,
  split_names,
)
from jpipe.data.digits import SklearnDigits, load_digits
from jpipe.data.stdlib_tasks import StdlibQa, StdlibTranslation
from jpipe.data.text import StdlibText, load_stdlib_text

__all__ = [
  "CheckedSource",
  "DatasetError",
  "SklearnDigits",
  "StdlibQa",
  "StdlibText",
  "StdlibTranslation",
  "load_digits",
  "load_stdlib_text",
  "open_checked",
  "prepared_source",
  "split_names",
]
