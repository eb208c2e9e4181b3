"""Megatron → HF export throughput, side by side on one synthetic checkpoint (CPU, page cache warm).

A Qwen3-style GPTModel (8 layers, hidden 1024, ffn 2816, vocab 32000, bf16; ~156 M params) is
built once in a spawned process (megatron-core + the CPU test shims), saved as `torch_dist`, and
exported live (collective path, world size 1). Then, in this process:
- `read`: plain sequential read of the checkpoint files (the I/O floor);
- `writer`: `write_snapshot` of the already-converted HF tensors from memory (writer only);
- `offline`: `export_megatron_checkpoint` end to end (stream per layer, convert, write).
Each is the median of `REPEATS` runs; ratios are relative to the offline export.
Needs the `megatron` extra; prints a skip line without it.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

REPEATS = 3
HIDDEN, FFN, LAYERS, VOCAB = 1024, 2816, 8, 32000


def _build_and_save(_rank: int, root: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    from pinned_eval.snapshot.megatron import export_live_model
    from tests import megatron_helpers as mh

    out = Path(root)
    mh.init_process_group(0, 1, port)
    try:
        mh.init_parallel(1)
        spec = mh.FamilySpec("qwen3", hidden=HIDDEN, heads=16, groups=8, head_dim=64, ffn=FFN, layers=LAYERS,
                             qk_layernorm=True)
        mh.write_hf_base(spec, out / "base", vocab=VOCAB)
        model = mh.build_model(spec, tp=1, vocab=VOCAB).to(torch.bfloat16)
        mh.save_torch_dist(model, out / "ckpt")
        live = []
        for i in range(REPEATS):
            res = export_live_model(model, str(out / "base"), str(out / f"live{i}"))
            live.append(res.seconds)
        (out / "live.json").write_text(json.dumps({"seconds": live, "bytes": res.bytes}))
    finally:
        dist.destroy_process_group()


def _read_all(ckpt: Path) -> int:
    n = 0
    for f in sorted(ckpt.iterdir()):
        with open(f, "rb") as fh:
            while chunk := fh.read(16 << 20):
                n += len(chunk)
    return n


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        print("megatron_export: skipped (megatron-core not installed)")
        return
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from pinned_eval.snapshot.megatron import export_megatron_checkpoint
    from pinned_eval.snapshot.writer import write_snapshot
    from tests.conftest import free_port

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="bench-mcore-") as tmp:
        root = Path(tmp)
        mp.start_processes(_build_and_save, args=(tmp, free_port()), nprocs=1, start_method="spawn")
        live = json.loads((root / "live.json").read_text())
        ckpt, base = root / "ckpt", str(root / "base")
        hf_bytes = live["bytes"]
        index = json.loads((root / "live0" / "model.safetensors.index.json").read_text())
        hf = {k: v for s in set(index["weight_map"].values()) for k, v in load_file(root / "live0" / s).items()}
        rows = {
            "read checkpoint files": [_timed(lambda: _read_all(ckpt)) for _ in range(REPEATS)],
            "write_snapshot from memory": [
                _timed(lambda i=i: write_snapshot(hf.items(), str(root / f"w{i}"), base_hf_dir=base))
                for i in range(REPEATS)],
            "export_megatron_checkpoint": [
                _timed(lambda i=i: export_megatron_checkpoint(ckpt, base, str(root / f"o{i}")))
                for i in range(REPEATS)],
            "export_live_model (TP=1)": live["seconds"],
        }
    ref = statistics.median(rows["export_megatron_checkpoint"])
    print(f"Megatron → HF export, {hf_bytes / 2**20:.0f} MiB bf16 snapshot, median of {REPEATS}")
    print(f"{'path':<30} {'seconds':>8} {'MiB/s':>8} {'time / offline':>15}")
    for name, secs in rows.items():
        s = statistics.median(secs)
        print(f"{name:<30} {s:8.3f} {hf_bytes / 2**20 / s:8.0f} {s / ref:15.2f}")


if __name__ == "__main__":
    main()
