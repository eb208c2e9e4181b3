"""The one YAML reader of the product: `block apply`'s `pinned-eval.yaml`, miles' eval YAML (suite
YAML, `suite miles`, `--from-yaml`).

Contract (`YamlFileError`, a `ValueError`, one line naming the file; never a traceback):
- `read_config_file` reads only a regular file: it opens with `O_NONBLOCK` and `fstat`s the open
  descriptor before reading, so a FIFO, a device, a socket or a directory is refused at once
  (never a hang); at most `MAX_BYTES` (1 MiB) are read, a larger file is refused; a NUL in the
  path is refused; the text must be UTF-8 (the error names the line);
- `parse_yaml` is `yaml.safe_load` plus: nesting deeper than `MAX_DEPTH` (64) is refused naming
  the line (never a `RecursionError`); more than `MAX_ALIASES` (100) aliases are refused (no
  exponential expansion); a key repeated in one mapping is refused naming the key and both lines;
  a syntax error gives the line and column, never PyYAML's snippet of the text;
- errors never echo the file's content: a key is named only when it looks like a key
  (`shown_key`: an identifier of at most 40 characters), else by its line.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any

import yaml

MAX_BYTES = 1 << 20
MAX_DEPTH = 64
MAX_ALIASES = 100
_KEY_LIKE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


class YamlFileError(ValueError):
    """A configuration file that cannot be read or is not acceptable YAML."""


def shown_key(key: object) -> str:
    """`key` as an error message may show it: an identifier-like key as is, anything else not."""
    return key if isinstance(key, str) and _KEY_LIKE.fullmatch(key) else "(a key that is not a name)"


def read_config_file(path: str | os.PathLike[str], name: str | None = None, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of the regular file `path` (see the module docstring); `name` for messages."""
    shown = name or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except ValueError:
        raise YamlFileError(f"{shown}: the path contains a NUL byte") from None
    except OSError as exc:
        raise YamlFileError(f"{shown}: cannot read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise YamlFileError(f"{shown}: not a regular file (a {_kind(st.st_mode)}); refused")
        if st.st_size > max_bytes:
            raise YamlFileError(f"{shown}: {st.st_size} bytes, more than the {max_bytes} a config file may have")
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise YamlFileError(f"{shown}: cannot read: {exc.strerror}") from None
    if len(data) > max_bytes:
        raise YamlFileError(f"{shown}: more than the {max_bytes} bytes a config file may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise YamlFileError(f"{shown}: not UTF-8 (line {line}, byte {exc.start}: {exc.reason})") from None


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return kind
    return "special file"


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: SafeConstructor refuses it below
            if first is not None:
                raise _DuplicateKey(key, line, first)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int) -> None:
        self.key, self.line, self.first = key, line, first


def _check_shape(text: str, name: str) -> None:
    depth = aliases = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise YamlFileError(f"{name}: nested more than {MAX_DEPTH} levels deep "
                                    f"(line {event.start_mark.line + 1})")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        elif isinstance(event, yaml.AliasEvent):
            aliases += 1
            if aliases > MAX_ALIASES:
                raise YamlFileError(f"{name}: more than {MAX_ALIASES} aliases (line {event.start_mark.line + 1})")


def parse_yaml(text: str, name: str) -> Any:
    """The document in `text` (see the module docstring); errors start with `name`."""
    try:
        _check_shape(text, name)
        return yaml.load(text, Loader=_Loader)
    except _DuplicateKey as dup:
        where = f"line {dup.line}" + (f", first at line {dup.first}" if dup.first != dup.line else "")
        raise YamlFileError(f"{name}: duplicate key {shown_key(dup.key)} ({where})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise YamlFileError(f"{name}: not valid YAML{at}: {problem}") from None


def load_yaml_file(path: str | os.PathLike[str], name: str | None = None) -> Any:
    """`parse_yaml(read_config_file(path))`: the one entry for a YAML file on disk."""
    shown = name or str(path)
    return parse_yaml(read_config_file(path, shown), shown)
