"""The workers of tools/gpu_check.py: each runs one stage as one rank under torchrun and
returns its result (the tool writes OUT_DIR/<stage>.json). The stages, their shapes and their
goals are described in tools/gpu_check.py's docstring."""

from megatron_parm.bench.gpu_check.chunks import worker_chunks
from megatron_parm.bench.gpu_check.experts import worker_experts
from megatron_parm.bench.gpu_check.layer import worker_layer, worker_syncs
from megatron_parm.bench.gpu_check.training import worker_modern, worker_overlap, worker_train

WORKERS = {"train": ("b", worker_train), "layer": ("c", worker_layer), "syncs": ("d", worker_syncs),
           "chunks": ("e", worker_chunks), "experts": ("f", worker_experts),
           "modern": ("h", worker_modern), "overlap": ("i", worker_overlap)}
