"""The model layer: the Haiku modules, AlphaFold 2's attention family, dropout, configs, AF2's
parameters and checkpoints, and AF2's own package built with these modules (af2_package)."""
