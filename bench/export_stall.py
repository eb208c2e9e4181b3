"""How long an in-loop export stalls the training loop: today's synchronous exporter against the
two-phase `StateDictExport`, both through `EvalClient.dispatch` (an unreachable API: the request
is spooled, fsync'd, as in any run).

State dict: Qwen3-4B's names and layout (36 layers x 11 tensors + embedding, final norm and an
untied lm_head = 399 tensors) in bf16; on a GPU (`--device cuda`, the default when CUDA is
available) at full size, 8.82 GB; on CPU every width divided by `--scale` (default 8: 138 MB).
Variants, alternating round by round so they share the load of the moment:
- `sync write_snapshot`: `export=lambda s, dest: write_snapshot(state_dict.items(), dest)` — the
  loop waits for the device-to-host copy, the shards, the fsyncs and the marker;
- `two-phase`: `export=StateDictExport(state_dict)` — the loop waits for the copy into the
  client's reused host buffer (pinned + non_blocking with CUDA); the snapshot is written in the
  background and the point requested after the marker.
Columns: `stall` = time until `dispatch` returns (what training waits); `complete` = time until the
snapshot's `.complete` marker exists and the request is spooled; `staging MB` = the client's
host buffer, reserved ahead (`HostStaging.reserve`, timed apart); `RSS MB` = the process's
resident memory after the variant's rounds.

`python -m bench export_stall [--device cpu|cuda] [--scale N] [--rounds N] [--dir PATH]`
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

from pinned_eval.snapshot.two_phase import StateDictExport
from pinned_eval.snapshot.writer import write_snapshot
from tests.conftest import free_port
from trainer_integration.client import EvalClient

LAYERS, HIDDEN, INTER, VOCAB, HEADS, KV, HEAD_DIM = 36, 2560, 9728, 151936, 32, 8, 128


def qwen3_4b_shapes(scale: int = 1) -> dict[str, tuple[int, ...]]:
    """Qwen3-4B's HF tensors (lm_head untied: 399 tensors); widths divided by `scale`."""
    h, i, v, d = HIDDEN // scale, INTER // scale, VOCAB // scale, HEAD_DIM
    q, kv = HEADS * d // scale, KV * d // scale
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        out |= {
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }
    out |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    return out


def _state_dict(device: str, scale: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return {n: torch.rand(s, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
            for n, s in qwen3_4b_shapes(scale).items()}


def _round(client: EvalClient, step: int, export: object) -> tuple[float, float]:
    t0 = time.perf_counter()
    result = client.dispatch(step, export=export)  # type: ignore[arg-type]
    stall = time.perf_counter() - t0
    if result.action not in ("requested", "exporting"):
        raise SystemExit(f"export_stall: step {step} was {result.action}: {result.reason}")
    client.wait_exports()
    return stall, time.perf_counter() - t0


def measure(sd: dict[str, torch.Tensor], work: Path, rounds: int) -> dict[str, dict[str, float]]:
    stats: dict[str, dict[str, list[float]]] = {"sync write_snapshot": {}, "two-phase": {}}
    out: dict[str, dict[str, float]] = {}
    api = f"http://127.0.0.1:{free_port()}/api"
    staging = work / "staging"
    with EvalClient("bench-stall", api, spool_dir=work / "spool", staging_root=staging, max_in_flight=64,
                    startup_sync_s=0) as client:
        t0 = time.perf_counter()  # the buffer allocated ahead, off the loop (pinned with CUDA)
        client.host_staging.reserve(sum(-(-t.numel() * t.element_size() // 64) * 64 for t in sd.values())).join()
        out["reserve"] = {"seconds": time.perf_counter() - t0}
        for rnd in range(rounds):
            for k, name in enumerate(stats):
                step = rnd * 2 + k
                export = StateDictExport(sd) if name == "two-phase" else (
                    lambda s, dest: write_snapshot(sd.items(), dest))
                stall, complete = _round(client, step, export)
                stats[name].setdefault("stall", []).append(stall)
                stats[name].setdefault("complete", []).append(complete)
                stats[name].setdefault("rss", []).append(psutil.Process().memory_info().rss)
                shutil.rmtree(staging / "bench-stall", ignore_errors=True)  # bounded disk: one snapshot
        for name, s in stats.items():
            out[name] = {
                "n": len(s["stall"]), "stall": statistics.median(s["stall"]),
                "complete": statistics.median(s["complete"]),
                "stall_min": min(s["stall"]), "stall_max": max(s["stall"]), "rss": max(s["rss"]),
                "staging": client.host_staging.capacity_bytes if name == "two-phase" else 0,
                "allocations": client.host_staging.allocations if name == "two-phase" else 0,
            }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench export_stall", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=int, default=None, help="divide every width (default: 1 on cuda, 8 on cpu)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where snapshots are written (default: a temp dir)")
    args = ap.parse_args(argv)
    scale = args.scale or (1 if args.device == "cuda" else 8)
    logging.getLogger("trainer_integration").setLevel(logging.CRITICAL)  # the API is unreachable on purpose
    sd = _state_dict(args.device, scale)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        res = measure(sd, Path(tmp), args.rounds)
    print(f"{len(sd)} tensors, {nbytes / 1e9:.3f} GB bf16 on {args.device} (scale 1/{scale}), {args.rounds} rounds")
    print(f"{'variant':<22}{'n':>3}{'stall p50 s':>13}{'stall min-max s':>18}{'complete p50 s':>16}"
          f"{'GB/s to complete':>18}{'staging MB':>12}{'allocs':>8}{'RSS MB':>9}")
    reserve = res.pop("reserve")["seconds"]
    for name, r in res.items():
        print(f"{name:<22}{r['n']:>3.0f}{r['stall']:>13.3f}{r['stall_min']:>9.3f}-{r['stall_max']:<8.3f}"
              f"{r['complete']:>16.3f}{nbytes / 1e9 / r['complete']:>18.2f}{r['staging'] / 1e6:>12.1f}"
              f"{r['allocations']:>8.0f}{r['rss'] / 1e6:>9.0f}")
    print(f"staging buffer reserved ahead (background thread, once per client): {reserve:.3f} s")
    sync, two = res["sync write_snapshot"], res["two-phase"]
    print(f"stall: {sync['stall'] / two['stall']:.1f}x shorter; complete: two-phase / sync = "
          f"{two['complete'] / sync['complete']:.2f}")


if __name__ == "__main__":
    main()
