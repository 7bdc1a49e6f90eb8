"""CheckpointError: the one exception of checkpointing/, for a checkpoint that cannot be used;
agree(): every rank's problems, so that all ranks raise together instead of some hanging."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with a message saying which one and why."""


def agree(problems: list) -> list:
    """Every rank's PROBLEMS (strings), in rank order without repeats. Collective."""
    import torch

    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, problems)
    merged = []
    for rank_problems in gathered:
        merged.extend(p for p in rank_problems if p not in merged)
    return merged
