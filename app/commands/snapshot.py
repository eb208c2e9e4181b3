"""`pinned-eval snapshot check|ls|mark`, `pinned-eval export` and `pinned-eval tiny-model`.

`snapshot mark DIR` is for checkpoints a user already has (e.g. `save_pretrained` output): it runs
every check of `snapshot check` except the marker's presence, and only when they all pass writes
the bare `.complete` marker (an empty file, as miles writes; the check then judges it stale when
any shard or the index is modified after it). `tiny-model` writes the engine's tiny model and
marks it the same way, so a point can use it as an `hf` source.

`tiny-model --out` and a local `export --out` write only a new directory (created 0700 below
trusted directories, `pinned_eval.trusted_paths.claim_new_dir`), an empty one of this user, or
their own earlier output; anything else (an empty value, `/`, `/etc`, a symlink, `/proc/self`)
is refused in one line, exit 2, before anything is written.

Exit codes: 0 success (check: the snapshot is complete; mark: it is marked or already was);
1 the snapshot is incomplete or the export failed (reason on stderr); 2 bad usage. S3
credentials come from the standard AWS environment variables (botocore reads them);
`--endpoint-url` (or `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`) points at MinIO, moto or another
S3-compatible store.
"""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer

from app.commands._cli import fail, in_words, refuse, short
from pinned_eval.snapshot.check import SnapshotCheck, SnapshotProblem, check_snapshot
from pinned_eval.snapshot.layout import MARKER, Manifest
from pinned_eval.snapshot.staging import Staging
from pinned_eval.trusted_paths import UntrustedPathError, claim_new_dir

TINY_CONTEXT = 4096  # > a prompt + the suite's default max_new_tokens (1024)

app = typer.Typer(help="Check and list HF snapshots (local or s3://).", no_args_is_help=True)

EndpointOpt = Annotated[
    str | None,
    typer.Option("--endpoint-url", envvar=["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"],
                 help="S3 endpoint URL (MinIO, moto, ...); credentials from AWS_* env vars."),
]
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """'2GB' -> 2e9 (decimal, as Hugging Face), '512MiB' -> 512 * 2**20, '1000' -> 1000 bytes."""
    m = _SIZE.match(text)
    if not m:
        raise typer.BadParameter(f"{text!r} is not a size like 2GB, 512MiB or 1000000")
    unit = (m.group(2) or "").lower().removesuffix("b")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise typer.BadParameter(f"{text!r} must be more than 0 bytes")
    return size


def _options(url: str, endpoint_url: str | None) -> dict[str, Any] | None:
    if "://" not in url or url.startswith("file://"):
        return None
    return {"endpoint_url": endpoint_url} if endpoint_url else {}


@app.command("check")
def check(
    path_or_url: Annotated[str, typer.Argument(help="Snapshot directory or s3://bucket/prefix.")],
    endpoint_url: EndpointOpt = None,
) -> None:
    """Exit 0 when the snapshot is complete; otherwise print the reason and exit 1."""

    if "\0" in path_or_url:
        refuse("PATH_OR_URL: a path cannot contain a NUL byte")
    if "://" in path_or_url and not path_or_url.startswith(("s3://", "s3a://", "file://")):
        refuse(f"PATH_OR_URL: {short(path_or_url)}: only a local directory or s3://bucket/prefix can be checked")
    try:
        result = check_snapshot(path_or_url, _options(path_or_url, endpoint_url))
    except Exception as exc:  # storage errors (no credentials, no such bucket, a name too long): one line
        hint = ""
        if path_or_url.startswith(("s3://", "s3a://")):
            hint = " (S3 credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; --endpoint-url for MinIO)"
        fail(f"{short(path_or_url)}: cannot check: {in_words(exc)}{hint}")
    if result.complete:
        typer.echo(f"{result.path}: {result.detail}")
        return
    fail(f"{result.path}: incomplete: {result.problem}: {result.detail}")


def mark_complete(directory: Path) -> tuple[SnapshotCheck, bool]:
    """Check `directory` as a snapshot without requiring the marker; when complete and unmarked,
    write the bare marker and check again. Returns (the last check, whether a marker was written);
    a marker that the check after writing refuses (a file dated in the future) is removed again."""
    first = check_snapshot(str(directory), require_marker=False)
    marker = directory / MARKER
    if not first.complete or marker.exists():
        return first, False
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    os.close(fd)
    after = check_snapshot(str(directory))
    if not after.complete:
        marker.unlink()
    return after, True


@app.command("mark")
def mark(
    path: Annotated[str, typer.Argument(metavar="DIRECTORY", help="A local HF checkpoint directory (config, "
                                        "tokenizer, safetensors weights).")],
) -> None:
    """Check a checkpoint you already have and, when it is complete, write its `.complete` marker
    (points refuse a snapshot without it as ckpt_missing)."""
    directory = Path(path)
    if "://" in path or not directory.is_dir():
        refuse(f"DIRECTORY: {path} is not a local directory")
    result, written = mark_complete(directory)
    if not result.complete:
        fix = (f"; if the files are final, remove {directory / MARKER} and mark again"
               if result.problem in (SnapshotProblem.STALE_MARKER, SnapshotProblem.BAD_MARKER) else "")
        fail(f"{result.path}: not marked: {result.problem}: {result.detail}{fix}")
    typer.echo(f"{result.path}: {'marked' if written else 'already marked'} {result.detail}")


_TINY_MODEL_FILES = re.compile(
    r"(\.complete|config\.json|generation_config\.json|chat_template\.jinja|tokenizer(_config)?\.json"
    r"|special_tokens_map\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json)"
)


def _is_tiny_model_output(path: str) -> bool:
    """Only the files `tiny-model` writes, all regular: an earlier tiny model, rewritten in place."""
    with os.scandir(path) as entries:
        return all(e.is_file(follow_symlinks=False) and _TINY_MODEL_FILES.fullmatch(e.name) for e in entries)


def _is_export_output(path: str) -> bool:
    """A snapshot an earlier `export` wrote: its marker holds pinned-eval's manifest."""
    marker = os.path.join(path, MARKER)
    if os.path.islink(marker) or not os.path.isfile(marker):
        return False
    try:
        with open(marker, "rb") as f:
            Manifest.model_validate_json(f.read(1 << 20))
    except (OSError, ValueError):
        return False
    return True


def tiny_model(
    out: Annotated[Path, typer.Option(help="Directory to write the snapshot into.")],
    arch: Annotated[str, typer.Option(help="llama, qwen2 or qwen3.")] = "llama",
    seed: Annotated[int, typer.Option(help="Weight init seed.")] = 0,
    max_shard_size: Annotated[str | None, typer.Option(help="Shard the weights, e.g. 100KB.")] = None,
    context_length: Annotated[
        int, typer.Option(min=64, max=1 << 20, help="The model's context (max_position_embeddings).")
    ] = TINY_CONTEXT,
) -> None:
    """Write a tiny HF causal LM + tokenizer, fully offline, marked complete (usable as an hf source).

    Its context (default 4096) holds a prompt plus the suite's default `max_new_tokens` (1024), so
    the README's suite examples measure on it as saved."""
    if arch not in ("llama", "qwen2", "qwen3"):
        refuse(f"--arch must be llama, qwen2 or qwen3, got {arch!r}")
    try:
        claim_new_dir(str(out), "--out", earlier_output=_is_tiny_model_output)
    except UntrustedPathError as exc:
        refuse(str(exc))
    from engine.tiny_model import make_tiny_model  # torch/transformers: `--help` stays fast

    (out / MARKER).unlink(missing_ok=True)  # rewriting the files: an old marker would vouch for them
    try:
        path = make_tiny_model(
            out, arch=arch, seed=seed, max_shard_size=max_shard_size, max_position_embeddings=context_length  # type: ignore[arg-type]
        )
    except OSError as exc:  # an unwritable or special --out (/proc/self, a file): one line naming the flag
        fail(f"--out: {in_words(exc)}")
    result, _ = mark_complete(path)
    if not result.complete:  # the engine wrote something the check refuses: a bug, said as such
        fail(f"{path}: written but not complete: {result.problem}: {result.detail}")
    typer.echo(str(path.resolve()))


@app.command("ls")
def ls(
    root: Annotated[str, typer.Argument(help="Staging root: a directory or s3://bucket/prefix.")],
    run: Annotated[str | None, typer.Option(help="Only this run's snapshots.")] = None,
    endpoint_url: EndpointOpt = None,
) -> None:
    """List the staged snapshots under ROOT: run, step, complete, retired, modified, path."""

    staging = Staging(root, storage_options=_options(root, endpoint_url))
    rows = staging.list(run)
    typer.echo(f"{'run':<20} {'step':>10} {'complete':>8} {'retired':>7}  {'modified (UTC)':<19}  path")
    for s in rows:
        when = datetime.fromtimestamp(s.mtime, UTC).strftime("%Y-%m-%d %H:%M:%S")
        typer.echo(f"{s.run:<20} {s.step:>10} {s.complete!s:>8} {s.retired!s:>7}  {when:<19}  {s.path}")


def export(
    out: Annotated[str, typer.Option("--out", help="Destination directory or s3://bucket/prefix.")],
    hf_base: Annotated[Path, typer.Option("--hf-base", help="Base HF dir: config and tokenizer files.",
                                          exists=True, file_okay=False)],
    megatron_ckpt: Annotated[Path | None, typer.Option("--megatron-ckpt", exists=True,
                                                       help="Megatron torch_dist checkpoint dir.")] = None,
    state_dict: Annotated[Path | None, typer.Option("--state-dict", exists=True, dir_okay=False,
                                                    help="State dict file: .safetensors, .pt, .bin.")] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Shard byte budget.")] = "2GiB",
    dtype: Annotated[str | None, typer.Option(help="Cast float weights (state dict): bfloat16...")] = None,
    endpoint_url: EndpointOpt = None,
) -> None:
    """Export a Megatron checkpoint or a state dict to an HF snapshot (marker last)."""
    if (megatron_ckpt is None) == (state_dict is None):
        raise typer.BadParameter("give exactly one of --megatron-ckpt and --state-dict")
    shard_bytes = parse_size(max_shard_size)
    opts = _options(out, endpoint_url)
    if opts is None:  # a local directory: new, empty, or an earlier export's, never another's
        try:
            claim_new_dir(out.removeprefix("file://"), "--out", earlier_output=_is_export_output, create=False)
        except UntrustedPathError as exc:
            refuse(str(exc))
    if megatron_ckpt is not None:
        if dtype is not None:
            raise typer.BadParameter("--dtype applies to --state-dict only (Megatron keeps the base dtype)")
        try:
            from pinned_eval.snapshot.megatron import (
                export_megatron_checkpoint,  # torch: slow import; `pinned-eval --help` stays fast
            )
        except ImportError as e:
            fail(f"Megatron export is not available in this install: {e}")
        run = partial(export_megatron_checkpoint, megatron_ckpt, str(hf_base), out,
                      max_shard_bytes=shard_bytes, storage_options=opts)
    else:
        import torch  # torch: slow import; `pinned-eval --help` stays fast

        from pinned_eval.snapshot.state_dict import (
            export_state_dict,  # torch: slow import; `pinned-eval --help` stays fast
        )

        cast = getattr(torch, dtype, None) if dtype else None
        if dtype and not isinstance(cast, torch.dtype):
            raise typer.BadParameter(f"--dtype {dtype!r} is not a torch dtype")
        assert state_dict is not None
        run = partial(export_state_dict, state_dict, hf_base, out, dtype=cast,
                      max_shard_bytes=shard_bytes, storage_options=opts)
    try:
        result = run()
    except (ValueError, KeyError, OSError) as e:  # plan/name mismatches, unreadable input, storage errors
        fail(f"export failed (partial output removed): {in_words(e)}")
    typer.echo(f"{result.path}: {result.shards} shards, {result.bytes} bytes in {result.seconds:.2f} s")
