"""Megatron-LM's whole training flag surface: the parser, the classification, the generated table
(docs/flags.md) and the stored facts of Megatron-LM's flags agree; a refused flag is one line,
a flag with no effect one start-up note."""

from __future__ import annotations

import argparse

import pytest

from launch import REPO
from megatron_parm import settings
from megatron_parm.settings import doc_table, megatron_lm, registry, surface

TINY_GPT = ["--config", str(REPO / "configs" / "gpt2_tiny_moe.yaml")]


def training_actions():
    parser = settings.training_parser()
    return parser, {option: action for action in parser._actions
                    for option in action.option_strings}


def test_the_facts_are_megatron_lm_s_parser():
    """Spot checks of the stored facts against Megatron-LM core_v0.16.1's parser."""
    assert len(megatron_lm.OPTIONS) == 651
    names = [name for opt in megatron_lm.OPTIONS.values() for name in opt.names]
    assert len(names) == len(set(names)) == 680
    opt = megatron_lm.option("--disable-bias-linear")
    assert (opt.kind, opt.inverted, opt.dest, opt.default) == ("switch", True, "add_bias_linear",
                                                               True)
    assert megatron_lm.option("--moe-token-dispatcher-type").default == "allgather"
    assert megatron_lm.option("--moe-aux-loss-coeff").nargs == "+"
    assert megatron_lm.option("--disable-tp-comm-bulk-wgrad").name == "--no-tp-comm-bulk-wgrad"
    assert megatron_lm.option("--lr-warmup-fraction").type is float


def test_each_flag_is_implemented_without_effect_or_refused():
    declared = {flag.name for flag in registry.DECLARATIONS}
    assert not set(surface.NO_EFFECT) & set(surface.REFUSED)
    assert set(surface.NO_EFFECT) | set(surface.REFUSED) <= set(megatron_lm.OPTIONS)
    # a declared flag is implemented (the planners' --vocab-size is training's too)
    assert not (set(surface.NO_EFFECT) | set(surface.REFUSED)) & declared
    for name in megatron_lm.OPTIONS:
        implemented = name in declared and name not in surface.NO_EFFECT
        assert implemented == (registry.status(name) == registry.IMPLEMENTED), name
    for reason in (*surface.NO_EFFECT.values(), *surface.REFUSED.values()):
        assert reason and ";" not in reason  # the one line separates flags with ";"


def test_declarations_keep_megatron_lm_s_facts_or_say_why():
    assert registry.check_declarations() == []
    assert megatron_lm.differences(settings.Flag("--seed", "x", default=1)) == ["default"]


def test_the_training_parser_takes_every_flag_with_its_type_and_default():
    parser, actions = training_actions()
    defaults = vars(parser.parse_args([]))
    for opt in megatron_lm.OPTIONS.values():
        flag = registry.FLAGS[opt.name]
        for name in opt.names:
            assert name in actions, name
        action = actions[opt.name]
        if registry.status(opt.name) == registry.IMPLEMENTED and flag.differs:
            continue
        if opt.kind == "switch":
            assert isinstance(action, argparse._StoreFalseAction if opt.inverted else
                              argparse._StoreTrueAction), opt.name
        elif opt.kind == "toggle":
            assert isinstance(action, argparse.BooleanOptionalAction), opt.name
        else:
            assert action.nargs == opt.nargs and action.type is opt.type, opt.name
            assert tuple(action.choices or ()) == tuple(opt.choices or ()), opt.name
        if len([o for o in megatron_lm.OPTIONS.values() if o.dest == opt.dest]) == 1:
            assert defaults[action.dest] == opt.default, opt.name


def test_the_docs_table_is_current_and_lists_every_flag():
    text = (REPO / doc_table.DOC).read_text()
    assert text == doc_table.markdown(), "run tools/flag_table.py"
    for opt in megatron_lm.OPTIONS.values():
        assert f"`{opt.name}`" in text
    rows = [line for line in text.splitlines() if line.startswith("| `--")]
    own = [flag for flag in registry.DECLARATIONS if megatron_lm.option(flag.name) is None]
    assert len(rows) == len(megatron_lm.OPTIONS) + len(own)
    assert "| `--hybrid-context-parallel` | refused | hybrid (dynamic) context parallelism" in text
    assert "| `--no-bias-gelu-fusion` | no effect | picks a fused GPU kernel" in text


def test_a_refused_flag_is_one_line_naming_each_and_why():
    with pytest.raises(ValueError) as error:
        settings.read(settings.training_parser(),
                      TINY_GPT + ["--hybrid-context-parallel", "--fp8-format", "hybrid",
                                  "--moe-token-dispatcher-type", "flex"])
    message = str(error.value)
    assert message.startswith("not available here: --hybrid-context-parallel: hybrid (dynamic) "
                              "context parallelism")
    assert "; --fp8-format hybrid: FP8 / FP4 training needs Transformer Engine" in message
    assert "; --moe-token-dispatcher-type flex: Megatron-Core's flex dispatcher needs DeepEP" \
        in message
    assert "\n" not in message
    # Megatron-LM's default value is what runs here anyway
    args = settings.read(settings.training_parser(), TINY_GPT + ["--context-parallel-size", "1"])
    assert settings.refusal(args) is None


def test_flags_without_effect_are_one_start_up_note(tmp_path):
    config = tmp_path / "mlm.yaml"
    config.write_text((REPO / "configs" / "gpt2_tiny_moe.yaml").read_text()
                      + "no_bias_gelu_fusion: true\nuse_mcore_models: true\n"
                        "exit_signal_handler_for_dataloader: true\nno_parm_tune: true\n")
    args = settings.read(settings.training_parser(),
                         ["--config", str(config), "--no-gradient-accumulation-fusion"])
    assert args.parm_tune is False and args.bias_gelu_fusion is False
    assert settings.no_effect_note(args) == (
        "note: no effect here: --exit-signal-handler-for-dataloader: Megatron-LM core_v0.16.1 "
        "reads it nowhere: with --exit-signal-handler the data loader's workers catch "
        "--exit-signal anyway, there as here; --no-bias-gelu-fusion, "
        "--no-gradient-accumulation-fusion: picks a fused GPU kernel, and the same computation "
        "runs unfused here; --use-mcore-models: always so here: Megatron-Core models and its "
        "distributed checkpoints")
    assert settings.no_effect_note(settings.read(settings.training_parser(), TINY_GPT)) is None


def test_config_keys_are_flags_with_their_aliases_and_no_forms(tmp_path):
    config = tmp_path / "keys.yaml"
    config.write_text("num_layers: 2\nvirtual_pipeline_model_parallel_size: 2\n"
                      "disable_tp_comm_bulk_wgrad: true\nmoe_aux_loss_coeff: 0.01\n")
    parser = settings.training_parser()
    values, _ = settings.config_values(str(config), parser)
    assert values == {"num_layers": 2, "virtual_pipeline_model_parallel_size": 2,
                      "tp_comm_bulk_wgrad": False, "moe_aux_loss_coeff": [0.01]}
    config.write_text("num_layer: 2\n")
    with pytest.raises(ValueError, match="unknown keys num_layer .*num_layer -> num_layers"):
        settings.config_values(str(config), parser)


def test_a_tool_s_own_flag_sharing_a_refused_name_is_not_refused():
    parser = settings.Parser()
    parser.add_argument("--warmup", type=int, default=1)  # a benchmark's warm-up iterations
    assert settings.read(parser, ["--warmup", "0"]).warmup == 0


def test_checkpoint_flags_as_config_keys_and_their_refused_values(tmp_path):
    """The checkpoint flags are config keys as on the command line (the BERT script reads the
    same parser); the values that do not run here are refused naming the flag and why."""
    config = tmp_path / "ckpt.yaml"
    config.write_text("ckpt_format: torch\nno_ckpt_fully_parallel_save: true\nno_save_optim: "
                      "true\ndist_ckpt_strictness: log_all\nsave_retain_interval: 4\nfinetune: "
                      "true\nno_use_tokenizer_model_from_checkpoint_args: true\n")
    values, _ = settings.config_values(str(config), settings.training_parser())
    assert values == {"ckpt_format": "torch", "ckpt_fully_parallel_save": False,
                      "no_save_optim": True, "dist_ckpt_strictness": "log_all",
                      "save_retain_interval": 4, "finetune": True,
                      "use_tokenizer_model_from_checkpoint_args": False}
    with pytest.raises(ValueError) as error:
        settings.read(settings.training_parser(),
                      TINY_GPT + ["--ckpt-format", "torch_dcp", "--non-persistent-ckpt-type",
                                  "local", "--replication"])
    assert str(error.value) == (
        "not available here: --replication: replicates local non-persistent checkpoints, which "
        "need NVIDIA's resiliency package (nvidia-resiliency-ext), not used here; --ckpt-format "
        "torch_dcp: torch_dcp is the format of torch FSDP2, which is not built here "
        "(torch_dist and torch are); --non-persistent-ckpt-type local: local (and in_memory) "
        "non-persistent checkpoints need NVIDIA's resiliency package (nvidia-resiliency-ext), "
        "which is not used here (global is built)")
    args = settings.read(settings.training_parser(), TINY_GPT + ["--async-save",
                                                                 "--ckpt-fully-parallel-save"])
    assert "--async-save: writes checkpoints in the background" in settings.no_effect_note(args)
    assert "--ckpt-fully-parallel-save: deprecated in Megatron-LM 0.16.1, which ignores it too" \
        in settings.no_effect_note(args)


def test_a_value_this_machine_cannot_run_is_refused_with_the_others(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformer_engine" else real(name, *a))
    with pytest.raises(ValueError, match="^not available here: --fp8-format hybrid: FP8 / FP4 "
                                         "training needs .*; --transformer-impl "
                                         "transformer_engine: needs Transformer Engine, which is "
                                         "not installed here \\(the transformer-engine "
                                         "package\\)$"):
        settings.read(settings.training_parser(),
                      TINY_GPT + ["--transformer-impl", "transformer_engine",
                                  "--fp8-format", "hybrid"])
