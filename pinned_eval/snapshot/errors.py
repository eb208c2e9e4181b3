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
