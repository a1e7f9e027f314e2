"""Engine settings declared once (engine/settings.py): every EngineConfig setting is a flag of
`serve` and `generate` with its declared help and choices, reaches the config by its name, and a
value its declaration refuses is refused on construction, naming the flag."""

from __future__ import annotations

import argparse
import typing

import msgspec
import pytest

from deepinfer.engine.config import EngineConfig, ModelConfigError
from deepinfer.engine.settings import flag, settings
from deepinfer.frontend import cli


def _actions(command: str) -> dict[str, argparse.Action]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {opt: a for a in sub.choices[command]._actions for opt in a.option_strings}


def _example(kind: type, decl: msgspec.Meta):
    """A value this setting accepts other than its default."""
    if decl.extra["choices"]:
        return decl.extra["choices"][-1]
    if typing.get_origin(kind) is list:
        return ["x=1", "y=2"]
    return {bool: True, int: 7, float: 2.5, str: "x"}[kind]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_setting_is_a_flag_with_its_declared_help_and_choices(command):
    actions = _actions(command)
    declared = settings(EngineConfig)
    assert len(declared) > 30
    for name, (kind, decl) in declared.items():
        action = actions[flag(name)]
        assert action.help == decl.description and action.default is None
        if kind is bool:
            assert "--no-" + flag(name)[2:] in actions
        elif typing.get_origin(kind) is list:  # several values after one flag
            assert action.nargs == "+"
        else:
            assert action.type is kind
            assert tuple(action.choices or ()) == decl.extra["choices"]


def test_each_flag_reaches_the_config_field_of_its_name():
    argv, expected = ["serve"], {}
    for name, (kind, decl) in settings(EngineConfig).items():
        value = _example(kind, decl)
        argv += ([flag(name)] if value is True else [flag(name), *value]
                 if isinstance(value, list) else [flag(name), str(value)])
        expected[name] = value
    assert cli.engine_kwargs(cli.build_parser().parse_args(argv)) == expected
    switches = cli.build_parser().parse_args(["serve", "--no-enable-prefix-caching"])
    assert cli.engine_kwargs(switches) == {"enable_prefix_caching": False}


def test_the_offline_llm_takes_the_same_names():
    """LLM(model, **settings) builds EngineConfig(model=..., **settings): an unknown name is
    a TypeError, a bad value the flag's error."""
    with pytest.raises(TypeError):
        EngineConfig(max_num_seq=4)
    with pytest.raises(ModelConfigError, match="--max-num-seqs must be at least 1, got 0"):
        EngineConfig(max_num_seqs=0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dtype": "float8"}, "--dtype must be one of float32, float16, bfloat16, not 'float8'"),
    ({"swa_replay": "all"}, "--swa-replay must be one of window, exact"),
    ({"kv_cache_gb": 0.0}, "--kv-cache-gb must be positive, got 0"),
    ({"host_kv_cache_gb": -1.0}, "--host-kv-cache-gb must be at least 0, got -1"),
    ({"swa_snapshot_interval": -16}, "--swa-snapshot-interval must be at least 0, got -16"),
    ({"grammar_compile_timeout": 0.0}, "--grammar-compile-timeout must be positive, got 0"),
    ({"kv_transfer_backend": "rdma"}, "--kv-transfer-backend must be one of zmq, nixl"),
    ({"node_rank": -1}, "--node-rank must be at least 0, got -1"),
])
def test_a_value_its_declaration_refuses_is_refused_by_flag(kwargs, message):
    with pytest.raises(ModelConfigError, match=message):
        EngineConfig(**kwargs)


def test_a_config_crossing_processes_is_checked_again():
    good = EngineConfig(max_num_seqs=3)
    assert EngineConfig.decode(good.encode()) == good
    bad = msgspec.msgpack.encode({**msgspec.to_builtins(good), "block_size": 0})
    with pytest.raises(msgspec.ValidationError, match="--block-size must be at least 1"):
        EngineConfig.decode(bad)
