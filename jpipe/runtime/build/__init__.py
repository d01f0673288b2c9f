"""Building a pipeline before anything runs: its options checked, its
stages cut and placed (devices, replica groups, the transport between
processes), their programs compiled, their memory predicted, the
per-call action lists and the weight-version policy decided. Nothing
here imports ``execute``."""
