"""The training entry point: ``python -m jpipe.train --config ... --workdir``.

``train_and_evaluate(config, workdir)`` is the library function behind it.
"""

from jpipe.train.train_lib import train_and_evaluate

__all__ = ["train_and_evaluate"]
