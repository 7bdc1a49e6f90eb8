"""Parm's dispatchers set up the way a Megatron-Core user sets them up, in one process: Megatron's
own parallel_state.initialize_model_parallel (nothing of megatron_parm.parallel), a plain
TransformerConfig or ParmTransformerConfig. The multi-rank equivalence suite
(tests/distributed/test_dispatchers.py) runs every layout the same way."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_parm import schedules

DISPATCHERS = list(schedules.names(schedules.BASELINE, schedules.PARM, schedules.AUTO))


def _layer(dispatcher: str, plain: bool, **settings):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_parm.config import ParmTransformerConfig
    from megatron_parm.layer import ParmMoELayer
    from megatron_parm.specs import get_gpt_layer_parm_spec

    config = (TransformerConfig if plain else ParmTransformerConfig)(
        num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
        moe_ffn_hidden_size=32, num_moe_experts=4, moe_router_topk=2,
        moe_token_dispatcher_type=dispatcher, use_cpu_initialization=True, add_bias_linear=False,
        **settings)
    torch.manual_seed(0)
    return ParmMoELayer(config, get_gpt_layer_parm_spec(num_experts=4).submodules.mlp.submodules)


def _run(layer):
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out, _ = layer(x)
    out.backward(torch.ones_like(out))
    return out.detach(), x.grad


@pytest.mark.parametrize("plain", [True, False], ids=["TransformerConfig", "ParmTransformerConfig"])
def test_every_dispatcher_builds_and_runs_after_megatrons_own_setup(megatron_world, plain):
    reference = _run(_layer("alltoall", plain))
    for name in DISPATCHERS:
        out, grad = _run(_layer(name, plain))
        torch.testing.assert_close(out, reference[0], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(grad, reference[1], rtol=1e-5, atol=1e-6, msg=name)


def test_plain_config_takes_the_documented_defaults(megatron_world):
    from megatron_parm import tuning
    from megatron_parm.config import ParmTransformerConfig, parm_setting

    layer = _layer("parm", plain=True)
    assert parm_setting(layer.config, "parm_tune_margin") == tuning.DEFAULT_MARGIN
    assert parm_setting(layer.config, "parm_tune_steps") == \
        ParmTransformerConfig.__dataclass_fields__["parm_tune_steps"].default
    with pytest.raises(KeyError, match="parm_no_such_setting is not a ParmTransformerConfig"):
        parm_setting(layer.config, "parm_no_such_setting")


def test_parm_leaves_out_a_parm_hier_that_cannot_run(megatron_world, monkeypatch, caplog):
    """A layout parm_hier refuses (its node groups raise ValueError naming the flag): parm
    builds without it, says so in one logged line, and never chooses it."""
    from megatron_parm.dispatchers import parm_hier

    def refuse(*args, **kwargs):
        raise ValueError("--parm-ranks-per-node 3: the EP group does not split evenly by node")

    monkeypatch.setattr(parm_hier, "node_groups", refuse)
    with caplog.at_level(logging.WARNING):
        layer = _layer("parm", plain=False)
    lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert lines == [f"parm: candidate {name} left out: --parm-ranks-per-node 3: the EP group "
                     f"does not split evenly by node" for name in ("parm_hier", "parm_hier_s2")]
    assert not {"parm_hier", "parm_hier_s2"} & set(layer.token_dispatcher.schedules)
    _run(layer)
    assert "parm_hier" not in str(layer.token_dispatcher.choice.schedule)
    with pytest.raises(ValueError, match="--parm-ranks-per-node 3"):
        _layer("parm_hier", plain=False)


def test_parm_leaves_out_allgather_where_megatron_refuses_it(megatron_world, caplog):
    """Megatron-Core refuses its allgather dispatcher with variable sequence lengths (a check
    of its config by the dispatcher's name, which parm's layers pass as alltoall's): parm
    builds without it, says so in one logged line, and keeps it elsewhere."""
    assert "allgather" in _layer("parm", plain=False).token_dispatcher.schedules
    with caplog.at_level(logging.WARNING):
        layer = _layer("parm", plain=False, variable_seq_lengths=True)
    lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert lines == ["parm: candidate allgather left out: Megatron-Core's allgather dispatcher "
                     "does not take variable sequence lengths (--variable-seq-lengths): its "
                     "all-gather needs as many tokens on every rank"]
    assert "allgather" not in layer.token_dispatcher.schedules
