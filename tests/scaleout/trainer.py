"""A trainer process on the harness's trainer host: `python -m tests.scaleout.trainer CONFIG.json`.

Dispatches one point per step (`steps` of them; the last one final when `final`) with in-loop export of the tiny
model into the S3 staging root (credentials read from the staging block over the API), through
`EvalClient` against `PREFECT_API_URL` (the load balancer) with the credential of
`PINNED_EVAL_API_AUTH_FILE`; after each dispatch it rewrites `<out>.progress` with the number of
dispatches so far (the test waits on it to inject a fault mid-burst). Then it drains and writes
every `PointOutcome` and every `DispatchResult` to `out` as JSON.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from pinned_eval.events import BlockNames
from trainer_integration.client import EvalClient


def main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    from safetensors.torch import load_file

    from pinned_eval.snapshot.writer import write_snapshot

    model = Path(cfg["model"])
    tensors: dict = {}
    for shard in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(shard))
    named = sorted(tensors.items())
    client = EvalClient(
        cfg["run"], blocks=BlockNames(**cfg["blocks"]), policy=cfg["policy"], max_in_flight=cfg["max_in_flight"],
        staging_root=cfg["staging_root"], spool_dir=cfg["spool_dir"], deployment=cfg["deployment"],
    )

    def export(step: int, dest: str) -> None:
        write_snapshot(named, dest, base_hf_dir=str(model), max_shard_bytes=64 * 1024,
                       storage_options=client.storage_options)

    client.exporter = export
    out = Path(cfg["out"])
    progress = out.with_suffix(".progress")
    pause = threading.Event()
    dispatched = []
    try:
        for step in range(cfg["steps"]):
            pause.wait(cfg["step_seconds"])  # "training"
            client.report_progress(step)
            final = cfg["final"] and step == cfg["steps"] - 1
            dispatched.append(client.dispatch(step, final=final).model_dump(mode="json"))
            progress.write_text(str(step + 1))
        outcomes = client.drain(timeout=cfg["drain_timeout_s"])
    finally:
        client.close()
    out.write_text(json.dumps({"outcomes": [o.model_dump(mode="json") for o in outcomes], "dispatched": dispatched}))


if __name__ == "__main__":
    main(sys.argv[1])
