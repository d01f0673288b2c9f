"""Datasets as local TFDS builders over data that ships with packages."""

from jpipe.data._local_tfds import split_names
from jpipe.data.digits import SklearnDigits, load_digits
from jpipe.data.text import StdlibText, load_stdlib_text

__all__ = [
  "SklearnDigits",
  "StdlibText",
  "load_digits",
  "load_stdlib_text",
  "split_names",
]
