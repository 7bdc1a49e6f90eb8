"""megatron-parm: Parm's MoE dispatchers (arXiv 2407.00599) as a Megatron-Core plug-in."""

# The one place of the version: packaging reads it (pyproject.toml), checkpoints' manifests
# and parm's tuning caches record it, and CHANGELOG.md's latest entry names it.
__version__ = "0.1.0"


def __getattr__(name: str):
    # megatron_parm.hide_library_warnings (megatron_parm.cli's), imported when first asked for:
    # importing megatron_parm itself imports nothing and changes nothing.
    if name == "hide_library_warnings":
        from megatron_parm.cli import hide_library_warnings

        return hide_library_warnings
    raise AttributeError(f"module 'megatron_parm' has no attribute {name!r}")
