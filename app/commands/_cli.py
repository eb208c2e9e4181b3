"""The command line's one error boundary: every verb's outcome becomes one line and an exit code.

`PinnedTyper` is a Typer whose `command` (and every command of a Typer added with `add_typer`,
the engine's too) runs inside `guarded`:
- `CliError` (raised by `fail`/`refuse`): `error: <message>` on stderr, exit `code` (1 the operation
  failed, 2 bad usage or input refused before anything is sent);
- pydantic's `ValidationError`: `error: <field or flag>: <message>` (`app.commands.errors`), exit 2;
- `typer.Exit` / click's own usage errors / Ctrl-C: unchanged (`request --wait` exits 3 and 4 so);
- anything else: ONE line, `error: <what happened, in words>`, exit 1 — the exception's type and the
  traceback only with `--debug` (or `PINNED_EVAL_DEBUG=1`), which prints the traceback first.
No Python traceback reaches a user who did not ask for one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click
import typer

DEBUG_ENV = "PINNED_EVAL_DEBUG"
ERROR_PREFIX = "error: "
_GUARDED = "__pinned_eval_guarded__"
F = TypeVar("F", bound=Callable[..., Any])
# Typer's own exits and usage errors (its click, and click's): exit codes 3/4, click's usage box
_CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
PASS_THROUGH: tuple[type[BaseException], ...] = (
    typer.Exit, typer.Abort, _CLICK_ERROR, click.exceptions.Exit, click.exceptions.Abort, click.ClickException,
    KeyboardInterrupt,
)


class CliError(Exception):
    """A refusal or failure the user reads as `error: <message>`; the process exits `code`."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def fail(message: str, code: int = 1) -> NoReturn:
    """Stop the verb: `error: <message>`, exit `code` (1 failed, 2 refused before anything was sent)."""
    raise CliError(message, code)


def refuse(message: str) -> NoReturn:
    """Bad usage or input (exit 2): nothing was sent."""
    raise CliError(message, 2)


_debug = False  # set by the root callback's `--debug` on every invocation


def set_debug(on: bool) -> None:
    global _debug
    _debug = on


def debug_enabled() -> bool:
    """`--debug` was given, or `PINNED_EVAL_DEBUG` is 1/true/yes/on."""
    return _debug or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def short(text: object, limit: int = 160) -> str:
    """`text` (a path, a URL) cut in the middle to at most `limit` characters, NUL bytes shown as `\\0`."""
    s = str(text).replace("\0", "\\0")
    return s if len(s) <= limit else f"{s[: limit // 2 - 2]}...{s[-(limit // 2 - 1):]}"


def in_words(exc: BaseException) -> str:
    """What went wrong, without the exception's class: an OS error as `PATH: reason`, else its text
    (first line only); a message-less exception says only that the operation failed unexpectedly."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{short(exc.filename)}: " if exc.filename is not None else ""
        return f"{where}{exc.strerror}"
    text = str(exc).strip()
    if isinstance(exc, KeyError) and text.startswith("'"):
        text = f"missing key {text}"
    line = text.splitlines()[0] if text else ""
    return line[:500] or "the operation failed unexpectedly"


def _report(exc: BaseException) -> NoReturn:
    from pydantic import ValidationError

    from app.commands.errors import human_errors

    if isinstance(exc, CliError):
        typer.echo(ERROR_PREFIX + exc.message, err=True)
        raise typer.Exit(exc.code) from None
    if isinstance(exc, ValidationError):
        typer.echo(ERROR_PREFIX + human_errors(exc), err=True)
        raise typer.Exit(2) from None
    if debug_enabled():
        traceback.print_exception(exc, file=sys.stderr)
        typer.echo(f"{ERROR_PREFIX}{type(exc).__name__}: {in_words(exc)}", err=True)
    else:
        typer.echo(f"{ERROR_PREFIX}{in_words(exc)} (--debug shows the traceback)", err=True)
    raise typer.Exit(1) from None


def guarded(fn: F) -> F:
    """`fn` with the boundary above around it (idempotent)."""
    if getattr(fn, _GUARDED, False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PASS_THROUGH:
            raise
        except RecursionError as exc:  # e.g. a deeply nested YAML file: said as such, never a traceback
            _report(CliError(f"input nested too deeply to read ({in_words(exc)})", 2))
        except Exception as exc:
            _report(exc)

    setattr(wrapper, _GUARDED, True)
    return wrapper  # type: ignore[return-value]


def guard_all(app: typer.Typer) -> None:
    """Put every command of `app` and of its sub-Typers (and their callbacks) behind the boundary."""
    for info in app.registered_commands:
        if info.callback is not None:
            info.callback = guarded(info.callback)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            guard_all(group.typer_instance)
    if app.registered_callback is not None and app.registered_callback.callback is not None:
        app.registered_callback.callback = guarded(app.registered_callback.callback)


class PinnedTyper(typer.Typer):
    """A Typer whose commands, and those of every Typer added to it, run behind `guarded`."""

    def command(self, *args: Any, **kwargs: Any) -> Callable[[F], F]:
        register = super().command(*args, **kwargs)

        def decorator(fn: F) -> F:
            register(guarded(fn))
            return fn

        return decorator

    def add_typer(self, typer_instance: typer.Typer, *args: Any, **kwargs: Any) -> None:
        guard_all(typer_instance)
        super().add_typer(typer_instance, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        guard_all(self)  # commands registered on sub-Typers after they were added
        try:
            return super().__call__(*args, **kwargs)
        except SystemExit as done:
            if "pyarrow" not in sys.modules:
                raise
            exit_without_native_teardown(done.code)


def exit_without_native_teardown(code: object) -> NoReturn:
    """End a CLI process that loaded Arrow: join the non-daemon threads and run the atexit hooks as
    a normal exit does, flush, then `os._exit` — skipping the C++ static destructors, where Arrow's
    thread pools, torn down with a worker still joinable, abort a finished process now and then
    (exit 134, "terminate called without an active exception": `compare`, 1 run in 5)."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # `sys.exit("message")`: printed, exit 1, as Python does
        print(code, file=sys.stderr)
        status = 1
    os._exit(status)


INT64_MAX = 2**63 - 1


def strict_count(value: Any) -> int:
    """A whole number written plainly: decimal digits, no sign, no leading zero, no `_`, no `.`,
    at most 2**63 - 1 (int64, what Prefect and the sinks store). `1.0`, `+1`, `1_000`, `01` are
    refused (click names the flag), never coerced. A Typer `parser=`."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value)
    if not (text.isascii() and text.isdigit()) or (len(text) > 1 and text[0] == "0"):
        raise typer.BadParameter(f"{text[:40]!r} is not a whole number like 0, 100 or 12000 (digits only)")
    number = int(text)
    if number > INT64_MAX:
        raise typer.BadParameter(f"{text[:40]}... is larger than {INT64_MAX} (int64)")
    return number


STEP = strict_count
