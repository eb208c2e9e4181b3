"""A stock Python tool in miles' retool contract, running the model's code in a sandbox.

miles' multi-turn generate function takes `--generate-tool-specs-path` (a list of OpenAI function
specs) and `--generate-execute-tool-function-path` (`async def execute_tool(name, params) -> str`).
Point them at `pinned_eval.sandbox.python_tool.tool_specs` and `...python_tool.execute_tool`
and a retool-style config runs with nothing else installed.

- `tool_specs` is miles' retool `code_interpreter` spec, word for word (it reaches the chat
  template, so another description would change the prompt).
- The code runs in the default sandbox (`bwrap`) under `SandboxLimits()`; `configure()` swaps the
  tool (another backend, other limits). At most `concurrency` runs at once.

The returned text is formatted as miles' retool example formats it:
- success: `Output:\\n<stdout>`, then `\\nErrors:\\n<stderr>` when the code wrote to stderr, the
  whole stripped (an empty string when it printed nothing);
- an exception: `Error: <message>\\nTraceback:\\n<traceback>` (what it printed before is dropped,
  as in miles);
- a non-zero exit (`sys.exit(n)`, a signal, the CPU limit): `Error: Process exited with code <n>\\n<stderr>`;
- the wall deadline: `Error: Code execution timed out after <wall_s> seconds`;
- an unknown tool: `Error: Tool '<name>' not found`; no code: `Error: No code provided`; code
  given as a list of lines is joined with newlines.
Differences from miles, on purpose: no regex blocklist of imports (the sandbox is the control, and
the blocklist refused harmless code); output over the cap gives `Error: Output exceeded <n> bytes`;
a traceback names the code `<code>` with its own line numbers.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from pinned_eval.sandbox import create_sandbox
from pinned_eval.sandbox.base import Outcome, RunResult, Sandbox, SandboxLimits

TOOL_NAME = "code_interpreter"
SNIPPET = "_snippet.py"

tool_specs: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "A tool for executing Python code in a safe sandbox environment.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The Python code to execute"}},
                "required": ["code"],
            },
        },
    }
]

# Runs inside the sandbox as main.py: the model's code from _snippet.py, its stdout/stderr captured
# (bounded) and formatted as miles' retool wrapper prints them.
_BOOTSTRAP = '''\
import io, linecache, sys, traceback
LIMIT = {limit}
class _Full(BaseException):
    pass
class _Capture(io.StringIO):
    used = [0]
    def write(self, s):
        self.used[0] += len(s)
        if self.used[0] > LIMIT:
            raise _Full()
        return super().write(s)
src = open({snippet!r}, encoding="utf-8").read()
linecache.cache["<code>"] = (len(src), None, src.splitlines(True), "<code>")
out, err = _Capture(), _Capture()
sys.stdout, sys.stderr = out, err
try:
    exec(compile(src, "<code>", "exec"), {{"__name__": "__main__"}})
    so, se = out.getvalue(), err.getvalue()
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    result = ""
    if so:
        result += f"Output:\\n{{so}}"
    if se:
        result += f"\\nErrors:\\n{{se}}"
    print(result)
except _Full:
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    print("Error: Output exceeded {cap} bytes")
except Exception as e:
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    tb = traceback.format_exception(type(e), e, e.__traceback__.tb_next)
    print(f"Error: {{str(e)}}\\nTraceback:\\n{{''.join(tb)}}")
'''


class PythonTool:
    """`tool_specs` plus `async execute_tool(name, params) -> str` over one sandbox."""

    def __init__(self, sandbox: Sandbox | None = None, limits: SandboxLimits | None = None, concurrency: int = 4):
        self.sandbox: Sandbox = sandbox if sandbox is not None else create_sandbox()
        self.limits = limits or SandboxLimits()
        self.tool_specs = tool_specs
        self._slots = threading.BoundedSemaphore(concurrency)

    @property
    def unsafe(self) -> bool:
        return self.sandbox.unsafe

    async def execute_tool(self, name: str, params: dict[str, Any]) -> str:
        if name != TOOL_NAME:
            return f"Error: Tool '{name}' not found"
        code = params.get("code", "") if isinstance(params, dict) else ""
        if isinstance(code, list):
            code = "\n".join(str(item) for item in code)
        if not isinstance(code, str) or not code.strip():
            return "Error: No code provided"
        return await asyncio.to_thread(self._run, code)

    def _run(self, code: str) -> str:
        cap = self.limits.output_bytes
        bootstrap = _BOOTSTRAP.format(limit=max(64, cap - 256), snippet=SNIPPET, cap=cap)
        with self._slots:
            result = self.sandbox.run(bootstrap, files={SNIPPET: code}, limits=self.limits)
        return format_result(result, self.limits)


def format_result(result: RunResult, limits: SandboxLimits) -> str:
    """The tool's text for one run (see the module docstring)."""
    if result.outcome is Outcome.TIMEOUT:
        return f"Error: Code execution timed out after {limits.wall_s:g} seconds"
    if result.outcome is Outcome.OUTPUT_LIMIT:
        return f"Error: Output exceeded {limits.output_bytes} bytes"
    if result.outcome is Outcome.START_FAILED:
        return f"Error: Failed to execute code: {result.stderr.strip()}"
    if result.exit_code == 0:
        return result.stdout.strip()
    return f"Error: Process exited with code {result.exit_code}\n{result.stderr}"


_default: PythonTool | None = None
_default_lock = threading.Lock()


def default_tool() -> PythonTool:
    global _default
    with _default_lock:
        if _default is None:
            _default = PythonTool()
        return _default


def configure(tool: PythonTool | None) -> None:
    """Use `tool` for the module-level `execute_tool` (None: back to the default, built on first use)."""
    global _default
    with _default_lock:
        _default = tool


async def execute_tool(name: str, params: dict[str, Any]) -> str:
    """miles' `--generate-execute-tool-function-path` contract, on the configured tool."""
    return await default_tool().execute_tool(name, params)


execute = execute_tool
