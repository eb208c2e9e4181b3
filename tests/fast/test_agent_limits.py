"""The point gateway's limits come from the suite (`agent_*` fields, docs/blocks.md): inherited like
every dataset field, accepted as extension keys in a miles YAML, refused under strict miles, and the
same for every agentic dataset of a point (one gateway serves them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pinned_eval.gateway import GatewayLimits
from pinned_eval.rollout.function import gateway_limits
from pinned_eval.suite import EvalSuite

FIXTURES = str(Path(__file__).parent.parent / "fixtures" / "miles_style")
YAML = """
eval:
  defaults:
    rm_type: math
    agent_max_requests: 40
    agent_max_tokens: 9000
    agent_max_turns: 4
    agent_sample_wall_s: 30
  datasets:
    - name: retool
      path: /d/retool.jsonl
      custom_generate_function_path: search_r1_style.generate
      tool_key: tools
      agent_max_tokens_per_sample: 2000
      agent_sample_timeout_s: 45
    - name: plain
      path: /d/plain.jsonl
"""


def test_miles_yaml_agent_limits_reach_the_gateway() -> None:
    retool, plain = EvalSuite.from_miles_yaml(YAML, base_dir=FIXTURES).resolved()
    assert gateway_limits([retool]) == GatewayLimits(max_requests=40, max_tokens=9000, max_turns_per_sample=4,
                                                     max_tokens_per_sample=2000, sample_wall_s=30.0)
    assert (retool.agent_sample_timeout_s, plain.agent_sample_timeout_s) == (45.0, 600.0)
    assert (plain.rollout, retool.rollout) == ("single_turn", "function")


def test_unset_limits_are_unbounded() -> None:
    text = ("eval:\n  defaults: {rm_type: math}\n  datasets:\n"
            "    - {name: a, path: /a.jsonl, custom_generate_function_path: echo_old.generate}\n")
    [ds] = EvalSuite.from_miles_yaml(text, base_dir=FIXTURES).resolved()
    assert gateway_limits([ds]) == GatewayLimits()


def test_strict_miles_refuses_the_extension_keys() -> None:
    with pytest.raises(ValueError, match=r"eval.datasets\[0\].agent_max_tokens_per_sample: a pinned-eval extension"):
        EvalSuite.from_miles_yaml(YAML, strict_miles=True, base_dir=FIXTURES)


def test_agentic_datasets_that_disagree_are_refused_naming_the_field() -> None:
    text = YAML.replace("      agent_sample_timeout_s: 45\n",
                        "      agent_sample_timeout_s: 45\n      agent_max_turns: 9\n")
    text = text.replace("      path: /d/plain.jsonl\n", "      path: /d/plain.jsonl\n"
                        "      custom_generate_function_path: echo_old.generate\n")
    with pytest.raises(ValueError, match=r"agent_max_turns: one gateway per point serves datasets \['retool', 'plain'"):
        EvalSuite.from_miles_yaml(text, base_dir=FIXTURES)


def test_a_plain_dataset_may_differ() -> None:
    text = YAML.replace("      path: /d/plain.jsonl\n", "      path: /d/plain.jsonl\n      agent_max_turns: 9\n")
    retool, plain = EvalSuite.from_miles_yaml(text, base_dir=FIXTURES).resolved()
    assert (retool.agent_max_turns, plain.agent_max_turns) == (4, 9)


def test_bad_value_is_named() -> None:
    with pytest.raises(ValueError, match="agent_max_turns"):
        EvalSuite.from_miles_yaml(YAML.replace("agent_max_turns: 4", "agent_max_turns: 0"), base_dir=FIXTURES)
