"""Host staging for two-phase in-loop exports: copy off the device now, write in the background.

Contract of `HostStaging` (one per `EvalClient`, or per writer rank of a collective export):
- it owns one flat host buffer holding at most **one snapshot's worth** of tensors (each view
  64-byte aligned): the first export allocates it (`allocations` counts every allocation; it
  stays 1 while the exported tensors keep their shapes and dtypes: every later export reuses
  it); a larger snapshot replaces it (the old one is freed first), so staging memory is bounded
  by the largest snapshot staged, never by the number of exports;
- with CUDA (`torch.cuda.is_available()`, or `pinned=True`) the buffer is page-locked
  (`pin_memory=True`), every tensor is copied with `non_blocking=True`, and one device
  synchronisation ends `stage` (a buffer is never handed on before its bytes arrived); without
  CUDA it is an ordinary host buffer and an ordinary copy, with the same semantics;
- a lease guards the buffer: `acquire(wait=...)` takes it (False when busy and not waiting),
  `release()` hands it back once the background write of what was staged is over; `stage`
  needs the lease, so a second export while one is being written never allocates;
- `reserve(nbytes)` allocates ahead, in a background thread under the lease (off the loop's
  critical path: the first export then only copies);
- `alloc(nbytes)`, `copy(dst, src)` and `synchronize()` can be injected (tests record them).

Two-phase exporters (`TwoPhaseExport`) stage a step's tensors into the buffer (`stage(step,
pool) -> Staged`) and write a snapshot from it later (`Staged.write(dest, storage_options)`,
marker last). The shipped ones are in `pinned_eval.snapshot.two_phase` (HF state dict, LoRA) and
`pinned_eval.snapshot.collective_staged` (Megatron, collective).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from pinned_eval.snapshot.errors import ExportError

if TYPE_CHECKING:  # torch is imported where a tensor is touched: a trainer module importing the
    import torch  # client (the producer, the gate) stays torch-free until it stages a snapshot

_ALIGN = 64
Layout = list[tuple[str, tuple[int, ...], "torch.dtype"]]


class StagingBusyError(ExportError, RuntimeError):
    """`stage` was called without holding the lease (a write of the previous snapshot runs)."""


@runtime_checkable
class Staged(Protocol):
    """A step's tensors on the host, ready to be written (phase 2, in the background)."""

    def write(self, dest: str, storage_options: dict[str, Any] | None = None) -> object: ...


@runtime_checkable
class TwoPhaseExport(Protocol):
    """Phase 1 (on the training loop's thread): copy the step's tensors into `pool`."""

    def stage(self, step: int, pool: HostStaging) -> Staged: ...


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    import torch

    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


class HostStaging:
    def __init__(
        self,
        *,
        pinned: bool | None = None,
        alloc: Callable[[int], torch.Tensor] | None = None,
        copy: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
        synchronize: Callable[[], object] | None = None,
    ) -> None:
        self._pinned = pinned
        self._alloc = alloc or self._default_alloc
        self._copy = copy or self._default_copy
        self._sync = synchronize or self._default_sync
        self.allocations = 0
        self._buffer: torch.Tensor | None = None
        self._lease = threading.Lock()
        self._idle = threading.Condition()
        self._held = False

    @property
    def pinned(self) -> bool:
        """Page-locked buffers: as constructed, else whether CUDA is available (asked on first use)."""
        if self._pinned is None:
            import torch

            self._pinned = torch.cuda.is_available()
        return self._pinned

    # ---- the lease ---------------------------------------------------------------------------

    def acquire(self, *, wait: bool, timeout: float | None = None) -> bool:
        """Take the buffer; when it is held (a write in progress): wait for it, or return False."""
        with self._idle:
            if self._held and not wait:
                return False
            if not self._idle.wait_for(lambda: not self._held, timeout):
                return False
            self._held = True
            return True

    def release(self) -> None:
        with self._idle:
            self._held = False
            self._idle.notify_all()

    @property
    def busy(self) -> bool:
        return self._held

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: not self._held, timeout)

    @property
    def capacity_bytes(self) -> int:
        """Bytes of host memory held for staging (0 before the first export)."""
        return 0 if self._buffer is None else int(self._buffer.numel())

    def reserve(self, nbytes: int) -> threading.Thread:
        """Allocate `nbytes` of buffer in a background thread (holding the lease meanwhile), so
        the first export does not pay for it on the loop's thread (pinning 8.8 GB took 5.6 s on an
        H200 host); an export that comes earlier follows its policy as for a write in progress."""

        def allocate() -> None:
            self.acquire(wait=True)
            try:
                if self._buffer is None or self._buffer.numel() < nbytes:
                    self._buffer = None
                    self._buffer = self._alloc(max(nbytes, 1))
                    self.allocations += 1
            finally:
                self.release()

        thread = threading.Thread(target=allocate, name="pinned-eval-staging-alloc", daemon=True)
        thread.start()
        return thread

    # ---- phase 1 -----------------------------------------------------------------------------

    def views(self, layout: Layout) -> dict[str, torch.Tensor]:
        """One view of the buffer per (name, shape, dtype), allocating only when it is too small."""
        if not self._held:
            raise StagingBusyError("stage: the staging buffer's lease is not held (acquire it first)")
        offsets: list[int] = []
        total = 0
        for _, shape, dtype in layout:
            offsets.append(total)
            total += -(-_nbytes(shape, dtype) // _ALIGN) * _ALIGN
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = None  # the old buffer is freed before the new one is allocated
            self._buffer = self._alloc(max(total, 1))
            self.allocations += 1
        out: dict[str, torch.Tensor] = {}
        for (name, shape, dtype), off in zip(layout, offsets, strict=True):
            raw = self._buffer[off : off + _nbytes(shape, dtype)]
            out[name] = raw.view(dtype).view(shape)
        return out

    def stage(
        self, tensors: Iterable[tuple[str, torch.Tensor]], dtypes: dict[str, torch.dtype] | None = None
    ) -> dict[str, torch.Tensor]:
        """Copy every tensor into the buffer (cast to `dtypes[name]` where given); returns when
        every byte is on the host (one synchronisation for all copies)."""
        items = [(n, t.detach()) for n, t in tensors]
        dtypes = dtypes or {}
        dst = self.views([(n, tuple(t.shape), dtypes.get(n, t.dtype)) for n, t in items])
        for name, t in items:
            self.copy(dst[name], t)
        self.synchronize()
        return dst

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Start one copy into a view of the buffer (asynchronous with CUDA: `synchronize` ends it)."""
        self._copy(dst, src)

    def synchronize(self) -> None:
        """Wait until every copy started so far has landed in the buffer."""
        self._sync()

    # ---- defaults: pinned + non_blocking with CUDA, plain copies without ----------------------

    def _default_alloc(self, nbytes: int) -> torch.Tensor:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def _default_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        import torch

        if src.device.type == "cpu" and src.dtype == dst.dtype and src.is_contiguous() and src.numel():
            # host to host, same dtype: a plain memcpy (torch's CPU copy_ measured 5-20x slower
            # than numpy's on a loaded 2-core machine, bench/export_stall.py)
            np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
        else:  # device to pinned host (asynchronous: `synchronize` ends it), or a cast
            dst.copy_(src, non_blocking=self.pinned)

    def _default_sync(self) -> None:
        import torch

        if self.pinned and torch.cuda.is_available():
            torch.cuda.synchronize()
