"""``python -m jpipe.launch``: ``jpipe.launch``'s docstring."""

import sys

from jpipe.launch import main

sys.exit(main())
