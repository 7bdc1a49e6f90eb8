"""GPT-2 as Hugging Face defines it, computed straight from its weights: the ground truth the
converted checkpoints are checked against. No Megatron, no transformers; also writes tiny
random GPT-2 directories in Hugging Face's file formats.

Notation: b batch, s sequence, H hidden, V vocabulary, nh heads, d head size.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Dict

import torch
import torch.nn.functional as F


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def gpt2_logits(weights: Dict[str, torch.Tensor], config: dict, tokens_bs: torch.Tensor) -> torch.Tensor:
    """tokens [b, s] -> logits [b, s, V]. Weights by Hugging Face name (Conv1D: [in, out])."""
    eps, heads = config.get("layer_norm_epsilon", 1e-5), config["n_head"]
    b, s = tokens_bs.shape
    x_bsH = weights["wte.weight"][tokens_bs] + weights["wpe.weight"][:s]
    hidden = x_bsH.shape[-1]
    d = hidden // heads
    causal = torch.ones(s, s, dtype=torch.bool).tril()

    def norm(name, t):
        return F.layer_norm(t, (hidden,), weights[f"{name}.weight"], weights[f"{name}.bias"], eps)

    def conv1d(name, t):
        return t @ weights[f"{name}.weight"] + weights[f"{name}.bias"]

    for i in range(config["n_layer"]):
        q, k, v = conv1d(f"h.{i}.attn.c_attn", norm(f"h.{i}.ln_1", x_bsH)).split(hidden, dim=-1)
        q, k, v = (t.reshape(b, s, heads, d).transpose(1, 2) for t in (q, k, v))  # [b, nh, s, d]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        attn = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
        x_bsH = x_bsH + conv1d(f"h.{i}.attn.c_proj", attn.transpose(1, 2).reshape(b, s, hidden))
        inner = tanh_gelu(conv1d(f"h.{i}.mlp.c_fc", norm(f"h.{i}.ln_2", x_bsH)))
        x_bsH = x_bsH + conv1d(f"h.{i}.mlp.c_proj", inner)
    return norm("ln_f", x_bsH) @ weights["wte.weight"].t()


def random_gpt2(config: dict, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Random weights of every GPT-2 tensor (norms near 1, nonzero biases, so that a mapping
    mistake in any of them shows)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inner = config["n_embd"], config.get("n_inner") or 4 * config["n_embd"]

    def rand(*shape, mean=0.0, std=0.05):
        return torch.randn(*shape, generator=gen) * std + mean

    weights = {"wte.weight": rand(config["vocab_size"], hidden, std=0.1),
               "wpe.weight": rand(config["n_positions"], hidden, std=0.1),
               "ln_f.weight": rand(hidden, mean=1.0, std=0.1), "ln_f.bias": rand(hidden)}
    for i in range(config["n_layer"]):
        for name, (n_in, n_out) in (("attn.c_attn", (hidden, 3 * hidden)),
                                    ("attn.c_proj", (hidden, hidden)),
                                    ("mlp.c_fc", (hidden, inner)), ("mlp.c_proj", (inner, hidden))):
            weights[f"h.{i}.{name}.weight"] = rand(n_in, n_out, std=0.1)
            weights[f"h.{i}.{name}.bias"] = rand(n_out)
        for name in ("ln_1", "ln_2"):
            weights[f"h.{i}.{name}.weight"] = rand(hidden, mean=1.0, std=0.1)
            weights[f"h.{i}.{name}.bias"] = rand(hidden)
    return weights


def write_safetensors(tensors: Dict[str, torch.Tensor], path: Path) -> None:
    """The safetensors layout: u64 header length, JSON header, then the tensors' bytes."""
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        data = tensor.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def write_hf_gpt2(directory: Path, config: dict, weights: Dict[str, torch.Tensor],
                  fmt: str = "safetensors") -> Path:
    """A directory as `save_pretrained` leaves it (names under 'transformer.' in the .bin, as
    GPT2LMHeadModel saves them; bare in the .safetensors, as GPT2Model does)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2", **config}))
    if fmt == "safetensors":
        write_safetensors(weights, directory / "model.safetensors")
    else:
        state = {f"transformer.{k}": v for k, v in weights.items()}
        positions = config["n_positions"]
        for i in range(config["n_layer"]):  # the causal-mask buffer older versions save
            state[f"transformer.h.{i}.attn.bias"] = torch.ones(positions, positions).tril()[None, None]
        state["lm_head.weight"] = weights["wte.weight"]  # tied
        torch.save(state, directory / "pytorch_model.bin")
    return directory
