"""What a failed export is (a point's `export_failed` skip), as opposed to a bug or a bad configuration.

`EXPORT_ERRORS` are storage and converter failures: `OSError` (local disk full, fsspec/s3fs
errors, a missing checkpoint), safetensors' `SafetensorError` (an unreadable weights file),
`NotImplementedError` (a layout the converters do not support) and every `ExportError` of this
package (the writer's plan violations, state-dict/architecture mismatches, unmapped Megatron
tensors, ranks that disagree, an incomplete snapshot). Anything else raised during an export (a
`TypeError`, a pydantic `ValidationError`, a configuration `ValueError`) is a programming or
configuration error and fails loudly. Imports no torch.
"""

from __future__ import annotations

from safetensors import SafetensorError


class ExportError(Exception):
    """Base of this package's export failures (each also subclasses the builtin it always was)."""


EXPORT_ERRORS: tuple[type[BaseException], ...] = (ExportError, OSError, SafetensorError, NotImplementedError)


class ConversionError(ExportError, ValueError):
    """A checkpoint or config the converters cannot turn into the HF layout (names what does not fit)."""


class ExportPathError(ExportError, ValueError):
    """A destination below a directory another user could redirect or fill (`pinned_eval.trusted_paths`)."""


def make_export_dirs(path: str) -> None:
    """`trusted_paths.make_private_dirs` for a snapshot destination; refusal is an `ExportPathError`."""
    from pinned_eval.trusted_paths import UntrustedPathError, make_private_dirs

    try:
        make_private_dirs(path, "snapshot directory")
    except UntrustedPathError as exc:
        raise ExportPathError(str(exc)) from None
