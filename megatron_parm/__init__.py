"""megatron-parm: Parm's MoE dispatchers (arXiv 2407.00599) as a Megatron-Core plug-in."""

# The one place of the version: packaging reads it (pyproject.toml), checkpoints' manifests
# and parm's tuning caches record it, and CHANGELOG.md's latest entry names it.
__version__ = "0.1.0"
