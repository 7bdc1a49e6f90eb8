"""Activation recomputation as Megatron-Core 0.16.1 runs it: the memory and step-time models.

A choice is Megatron-LM's four flags (--recompute-granularity, --recompute-method,
--recompute-num-layers, --recompute-modules; megatron_parm/settings.py declares them, the
trainer passes them to TransformerConfig). What each one keeps of a transformer layer, in the
terms of memory.py's activation table (Megatron-Core's transformer_block._checkpointed_forward,
transformer_layer, attention, moe_layer and experts):

    full       a recomputed layer keeps only its input, n h p (tensor_parallel.checkpoint saves
               the hidden states it is given; the attention mask is the micro-batch's one copy);
               uniform: every run of N consecutive layers of a model chunk is one checkpoint
               (N = --recompute-num-layers), block: the first N layers of each chunk are one
               checkpoint each, the others keep everything. In the backward pass one
               checkpoint's layers are recomputed at a time, their activations live until its
               backward is done.
    selective  per layer, dropped:
        core_attn       the softmax output and the attention dropout (the b (a/t) s^2 terms);
                        Q, K, V and the projection input stay (the checkpoint's inputs and
                        output)
        layernorm       both norms' statistics and outputs, their inputs kept by the
                        checkpoint: the layer's `layernorms` term (CheckpointWithoutOutput)
        mlp             a dense layer's MLP but its input (the norm output, kept)
        moe             an MoE layer's router, dispatcher, experts and shared experts but its
                        input (the norm output)
        moe_act         the experts' activation and its probability-scaled output; fc1's output
                        stays (needs --moe-grouped-gemm)
        shared_experts  the shared experts' fc1 output and activation
        mla_up_proj     multi-latent attention, which the planner does not model: nothing
               The backward pass recomputes a layer's MLP side (mlp, moe, moe_act,
               shared_experts) while the layer's other tensors are still kept: that layer's
               peak; the attention's modules come after the MLP side's tensors are freed.
               Under GQA the K and V that core_attn repeats to a heads are counted as kept
               (an overestimate: the checkpoint keeps them at g heads).

Time: what a choice does not keep, the backward pass computes again; step_time.py charges
that forward work (full: each recomputed layer's whole forward; selective: the modules'
forward, e.g. moe's router, dispatcher and experts); recomputed_layers says which layers.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

# Megatron-Core 0.16.1's selective recompute modules (TransformerConfig.recompute_modules).
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                     "shared_experts")
GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
DEFAULT_MODULES = ("core_attn",)  # TransformerConfig's default


@dataclass(frozen=True)
class Recompute:
    """One activation-recompute choice (granularity None: none), checked as Megatron-Core's
    TransformerConfig checks it; ValueError naming the flag otherwise."""

    granularity: Optional[str] = None
    method: Optional[str] = None
    num_layers: Optional[int] = None
    modules: Tuple[str, ...] = DEFAULT_MODULES

    def __post_init__(self):
        object.__setattr__(self, "modules", tuple(self.modules or DEFAULT_MODULES))
        problem = self._problem()
        if problem:
            raise ValueError(problem)

    def _problem(self) -> Optional[str]:
        if self.granularity not in (None,) + GRANULARITIES:
            return (f"--recompute-granularity must be one of {', '.join(GRANULARITIES)}, "
                    f"got {self.granularity!r}")
        unknown = sorted(set(self.modules) - set(RECOMPUTE_MODULES))
        if unknown:
            return (f"--recompute-modules: unknown {', '.join(unknown)} (choose from "
                    f"{', '.join(RECOMPUTE_MODULES)})")
        if self.granularity == "full":
            if self.method not in METHODS or not self.num_layers or self.num_layers < 1:
                return ("--recompute-granularity full needs --recompute-method uniform|block "
                        "and a positive --recompute-num-layers")
        elif self.method is not None or self.num_layers is not None:
            return ("--recompute-method and --recompute-num-layers go with "
                    "--recompute-granularity full")
        return None

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    def selects(self, module: str) -> bool:
        """True where selective recomputation recomputes `module` (RECOMPUTE_MODULES)."""
        return self.granularity == "selective" and module in self.modules

    def flags(self) -> List[str]:
        """Megatron-LM's flags for this choice (none without recomputation)."""
        if self.granularity is None:
            return []
        flags = ["--recompute-granularity", self.granularity]
        if self.full:
            return flags + ["--recompute-method", self.method,
                            "--recompute-num-layers", str(self.num_layers)]
        return flags + ([] if self.modules == DEFAULT_MODULES else
                        ["--recompute-modules", *self.modules])

    def label(self) -> str:
        """`-`, `full uniform 1`, `selective core_attn,moe`."""
        if self.granularity is None:
            return "-"
        if self.full:
            return f"full {self.method} {self.num_layers}"
        return "selective " + ",".join(self.modules)

    def units(self, num_layers: int) -> List[Sequence[int]]:
        """The checkpoints of a model chunk of num_layers layers: each one's local layer
        indices (full granularity; none otherwise)."""
        if not self.full:
            return []
        if self.method == "uniform":
            step = self.num_layers
            return [range(start, min(start + step, num_layers))
                    for start in range(0, num_layers, step)]
        return [range(index, index + 1) for index in range(min(self.num_layers, num_layers))]

    def recomputed_layers(self, num_layers: int) -> List[int]:
        """The local indices of a model chunk's layers whose forward (whole, or the selected
        modules) runs again in the backward pass."""
        if self.granularity == "selective":
            return list(range(num_layers))
        return [index for unit in self.units(num_layers) for index in unit]


NONE = Recompute()


def search_choices(layers_per_chunk: int) -> List[Recompute]:
    """What the planner tries where a layout does not fit without recomputation, cheapest
    (least recomputed) first: selective core_attn (Megatron's default), then the MoE layer
    too, then full block for 1, 2, 4, ... layers of a chunk (fewer than all: a few tries
    however deep the chunk), then full uniform 1."""
    choices = [Recompute("selective"), Recompute("selective", modules=("core_attn", "moe"))]
    count = 1
    while count < layers_per_chunk:
        choices.append(Recompute("full", "block", count))
        count *= 2
    return choices + [Recompute("full", "uniform", 1)]
