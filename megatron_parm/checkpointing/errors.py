"""CheckpointError: the one exception of checkpointing/, for a checkpoint that cannot be used."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with a message saying which one and why."""
