"""Datasets as local TFDS builders over data that ships with packages."""

from jpipe.data.digits import SklearnDigits, load_digits

__all__ = ["SklearnDigits", "load_digits"]
