"""The stock Python tool in miles' retool contract (`pinned_eval.sandbox.python_tool`).

Expected texts are what miles' retool example (`examples/retool_v2/tool_sandbox.py`) returns for
the same code: its wrapper captures stdout/stderr and prints `Output:` / `Errors:` / `Error: ...`.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Iterator

import pytest

from pinned_eval.sandbox import BwrapSandbox, SandboxLimits, create_sandbox
from pinned_eval.sandbox import python_tool as tool_module
from pinned_eval.sandbox.python_tool import PythonTool, configure, execute_tool
from tests.sandboxkit import require_bwrap, sandbox_uid_processes

# miles' retool `code_interpreter` spec, word for word (it reaches the chat template)
MILES_RETOOL_SPECS = [
    {
        "type": "function",
        "function": {
            "name": "code_interpreter",
            "description": "A tool for executing Python code in a safe sandbox environment.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The Python code to execute"}},
                "required": ["code"],
            },
        },
    }
]


@pytest.fixture
def sandbox() -> BwrapSandbox:
    return require_bwrap()


@pytest.fixture
def tight(sandbox: BwrapSandbox) -> Iterator[PythonTool]:
    tool = PythonTool(sandbox, SandboxLimits(wall_s=2, output_bytes=1000, memory_mb=256))
    configure(tool)
    yield tool
    configure(None)


def load_function(path: str) -> object:
    """miles' `load_function`: dotted `module.attr` (rpartition on the last dot)."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def test_the_miles_paths_resolve_to_the_retool_spec_and_an_async_executor() -> None:
    assert load_function("pinned_eval.sandbox.python_tool.tool_specs") == MILES_RETOOL_SPECS
    executor = load_function("pinned_eval.sandbox.python_tool.execute_tool")
    assert inspect.iscoroutinefunction(executor)
    assert list(inspect.signature(executor).parameters) == ["name", "params"]
    assert tool_module.execute is executor  # the name the issue uses, the same function


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("print(1 + 1)", "Output:\n2"),
        ("import sys\nprint('a')\nprint('b', file=sys.stderr)", "Output:\na\n\nErrors:\nb"),
        ("import sys\nprint('only err', file=sys.stderr)", "Errors:\nonly err"),
        ("x = 1", ""),
        (["a = 2", "print(a ** 10)"], "Output:\n1024"),  # a list of lines is joined, as newer miles does
        ("print('dropped')\n1 / 0",
         "Error: division by zero\nTraceback:\nTraceback (most recent call last):\n"
         '  File "<code>", line 2, in <module>\n    1 / 0\n     ~~^~~\nZeroDivisionError: division by zero'),
        ("import sys\nprint('dropped')\nsys.exit(3)", "Error: Process exited with code 3\n"),
        ("import os\nprint(os.getcwd(), sorted(os.listdir('.')))", "Output:\n/work ['_snippet.py', 'main.py']"),
    ],
)
async def test_output_is_formatted_as_miles_retool_formats_it(sandbox: BwrapSandbox, code: object,
                                                              expected: str) -> None:
    configure(PythonTool(sandbox))
    try:
        assert await execute_tool("code_interpreter", {"code": code}) == expected
    finally:
        configure(None)


async def test_unknown_tools_and_missing_code_are_answered_without_running(tight: PythonTool) -> None:
    assert await execute_tool("web_search", {"query": "x"}) == "Error: Tool 'web_search' not found"
    assert await execute_tool("code_interpreter", {"code": "  \n"}) == "Error: No code provided"
    assert await execute_tool("code_interpreter", {}) == "Error: No code provided"


async def test_the_limits_reach_the_model_as_error_texts_and_nothing_is_left(tight: PythonTool) -> None:
    timed_out, flood, memory = await asyncio.gather(
        execute_tool("code_interpreter", {"code": "import time\ntime.sleep(600)"}),
        execute_tool("code_interpreter", {"code": "while True:\n    print('x' * 99)"}),
        execute_tool("code_interpreter", {"code": "b = bytearray(2 << 30)"}),
    )
    assert timed_out == "Error: Code execution timed out after 2 seconds"
    assert flood == "Error: Output exceeded 1000 bytes"
    assert memory == ("Error: \nTraceback:\nTraceback (most recent call last):\n"
                      '  File "<code>", line 1, in <module>\n    b = bytearray(2 << 30)\n         ^^^^^^^^^^^^^^^^^^\n'
                      "MemoryError")
    assert sandbox_uid_processes() == []


def test_the_default_tool_uses_bwrap_and_the_unsafe_one_says_so(sandbox: BwrapSandbox) -> None:
    configure(None)
    assert tool_module.default_tool().sandbox.name == "bwrap"
    assert tool_module.default_tool().unsafe is False
    unsafe = PythonTool(create_sandbox("unsafe_subprocess", allow_unsafe=True))
    assert unsafe.unsafe is True
    assert asyncio.run(unsafe.execute_tool("code_interpreter", {"code": "print(6 * 7)"})) == "Output:\n42"
