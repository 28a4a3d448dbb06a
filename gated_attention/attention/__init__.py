"""The attention op in jax.nn's layout: the entry point (api), the choice of implementation
(dispatch), what an implementation is (base), the XLA and cuDNN implementations, and one folder
per kernel family with the same roles: implementation (check, plan, call), plan (the static facts
of a call), kernels, and a pipeline or tile table."""
