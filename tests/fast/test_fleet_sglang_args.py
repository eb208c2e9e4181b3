"""Real-SGLang command building for GPU fleets (no GPU needed), ported from miles' server-config tests."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pinned_eval.fleet.sglang_args import (
    EVAL_DEFAULTS,
    SGLangFleetSpec,
    resolve_server_args,
    server_args_to_cli,
    sglang_engine_specs,
)

ROLLOUT = {
    "tp_size": 2,
    "dp_size": 2,
    "pp_size": 2,
    "ep_size": 2,
    "attn_cp_size": 2,
    "mem_fraction_static": 0.7,
    "dtype": "bfloat16",
    "enable_return_routed_experts": True,
    "port": 30000,
    "host": "0.0.0.0",
}


def spec(**kw: object) -> SGLangFleetSpec:
    base = {"model_path": "/ckpt/hf", "num_gpus": 4, "gpus_per_engine": 2, "base_args": ROLLOUT}
    return SGLangFleetSpec.model_validate({**base, **kw})


def test_eval_fleet_inherits_rollout_engine_settings() -> None:
    args = resolve_server_args(spec())
    assert args["model_path"] == "/ckpt/hf"
    assert args["mem_fraction_static"] == 0.7 and args["dtype"] == "bfloat16"
    for key, value in EVAL_DEFAULTS.items():  # replay side channels are off for eval
        assert args[key] is value is False
    assert "port" not in args and "host" not in args  # the launcher owns them


def test_tp_coupled_sizes_are_not_inherited_across_a_different_eval_tp() -> None:
    args = resolve_server_args(spec(gpus_per_engine=1))
    assert args["tp_size"] == 1
    assert [args[k] for k in ("dp_size", "pp_size", "ep_size", "attn_cp_size")] == [1, 1, 1, 1]


def test_tp_coupled_sizes_are_inherited_when_the_tp_matches() -> None:
    args = resolve_server_args(spec(gpus_per_engine=2))
    assert [args[k] for k in ("tp_size", "dp_size", "pp_size", "ep_size", "attn_cp_size")] == [2, 2, 2, 2, 2]


def test_eval_overrides_win_over_the_tp_coupled_defaults() -> None:
    args = resolve_server_args(spec(gpus_per_engine=1, overrides={"dp_size": 2}))
    assert args["dp_size"] == 2 and args["ep_size"] == 1


def test_overrides_beat_inherited_and_derived_values() -> None:
    args = resolve_server_args(
        spec(overrides={"dtype": "float16", "mem_fraction_static": 0.5, "enable_return_routed_experts": True})
    )
    assert (args["dtype"], args["mem_fraction_static"], args["enable_return_routed_experts"]) == ("float16", 0.5, True)


def test_overrides_reach_the_eval_fleet_only() -> None:
    before = dict(ROLLOUT)
    resolve_server_args(spec(gpus_per_engine=1, overrides={"dtype": "float16"}))
    assert before == ROLLOUT


def test_unset_overrides_produce_no_change() -> None:
    assert resolve_server_args(spec(overrides={})) == resolve_server_args(spec())


def test_a_boolean_override_can_turn_a_base_flag_back_off() -> None:
    s = spec(base_args={**ROLLOUT, "enable_dp_attention": True}, overrides={"enable_dp_attention": False})
    assert "--enable-dp-attention" not in server_args_to_cli(resolve_server_args(s))
    assert "--enable-dp-attention" in server_args_to_cli(
        resolve_server_args(spec(base_args={"enable_dp_attention": True}))
    )


def test_tp_size_is_not_exposed_as_an_override() -> None:
    with pytest.raises(ValidationError, match=r"overrides\.tp_size"):
        spec(overrides={"tp_size": 4})


@pytest.mark.parametrize("key", ["port", "host", "base_gpu_id", "model_path"])
def test_launcher_owned_keys_cannot_be_overridden(key: str) -> None:
    with pytest.raises(ValidationError, match=rf"overrides\.{key}"):
        spec(overrides={key: 1})


def test_gpus_must_divide_into_engines() -> None:
    with pytest.raises(ValidationError, match="multiple of gpus_per_engine"):
        spec(num_gpus=3, gpus_per_engine=2)
    with pytest.raises(ValidationError, match="gpu_ids"):
        spec(gpu_ids=[0, 1])
    with pytest.raises(ValidationError, match=r"base_args\.Bad-Name"):
        spec(base_args={"Bad-Name": 1})


def test_parallel_sizes_keep_server_args_flag_names() -> None:
    cli = server_args_to_cli({"model_path": "/m", "dp_size": 2, "ep_size": 4, "attn_cp_size": 1, "tp_size": 2})
    assert cli[:2] == ["--model-path", "/m"]
    assert cli[2:] == ["--attn-cp-size", "1", "--dp-size", "2", "--ep-size", "4", "--tp-size", "2"]


def test_cli_rendering_of_values() -> None:
    cli = server_args_to_cli(
        {
            "model_path": "/m",
            "skip_server_warmup": True,
            "disable_radix_cache": False,
            "api_key": None,
            "cuda_graph_bs": [1, 2, 4],
            "json_model_override_args": {"a": 1},
        }
    )
    assert cli == [
        "--model-path",
        "/m",
        "--cuda-graph-bs",
        "1",
        "2",
        "4",
        "--json-model-override-args",
        '{"a": 1}',
        "--skip-server-warmup",
    ]


def test_engine_commands_get_their_own_gpus_and_ports() -> None:
    s = spec(num_gpus=4, gpus_per_engine=2, gpu_ids=[4, 5, 6, 7], weight_version="base", python="/py")
    engines = sglang_engine_specs(s, [31001, 31002])
    assert [e.env["CUDA_VISIBLE_DEVICES"] for e in engines] == ["4,5", "6,7"]
    assert [e.url for e in engines] == ["http://127.0.0.1:31001", "http://127.0.0.1:31002"]
    cmd = engines[0].command
    assert cmd[:3] == ["/py", "-m", "sglang.launch_server"] and cmd[-4:] == ["--host", "127.0.0.1", "--port", "31001"]
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--weight-version") + 1] == "base"
    assert "30000" not in cmd and "0.0.0.0" not in cmd
    with pytest.raises(ValueError, match="ports"):
        sglang_engine_specs(s, [1])


def test_default_gpu_ids_are_consecutive() -> None:
    engines = sglang_engine_specs(spec(num_gpus=3, gpus_per_engine=1), [1, 2, 3])
    assert [e.env["CUDA_VISIBLE_DEVICES"] for e in engines] == ["0", "1", "2"]


def test_adapter_mode_enables_lora_at_launch() -> None:
    cli = server_args_to_cli(resolve_server_args(spec(lora_max_rank=16, lora_target_modules=["q_proj", "v_proj"])))
    assert "--enable-lora" in cli
    assert cli[cli.index("--max-lora-rank") + 1] == "16"
    i = cli.index("--lora-target-modules")
    assert cli[i + 1 : i + 3] == ["q_proj", "v_proj"]
    assert "--lora-paths" not in cli  # adapters come per point, with /load_lora_adapter
    every = server_args_to_cli(resolve_server_args(spec(lora_max_rank=8)))
    assert every[every.index("--lora-target-modules") + 1] == "all"
    assert every[every.index("--lora-target-modules") + 2].startswith("--")
    # an override still wins, and LoRA stays off unless asked for
    assert resolve_server_args(spec(lora_max_rank=8, overrides={"max_lora_rank": 32}))["max_lora_rank"] == 32
    off = resolve_server_args(spec())
    assert "enable_lora" not in off and "max_lora_rank" not in off


def test_lora_target_modules_need_a_rank() -> None:
    with pytest.raises(ValidationError, match="lora_target_modules: needs lora_max_rank"):
        spec(lora_target_modules=["q_proj"])


def test_tool_call_parser_reaches_the_command_and_an_override_still_wins() -> None:
    cmd = sglang_engine_specs(spec(tool_call_parser="qwen25"), [1, 2])[0].command
    assert cmd[cmd.index("--tool-call-parser") + 1] == "qwen25"
    assert resolve_server_args(spec(tool_call_parser="qwen25", overrides={"tool_call_parser": "hermes"}))[
        "tool_call_parser"
    ] == "hermes"
    assert "tool_call_parser" not in resolve_server_args(spec())
    with pytest.raises(ValidationError, match="tool_call_parser"):
        spec(tool_call_parser="qwen25 --api-key x")
