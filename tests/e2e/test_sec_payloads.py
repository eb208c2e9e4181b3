"""No code or paths from payloads, end to end on the real Prefect server.

Whoever can post a `pinned-eval.point.requested` event or create a flow run on the deployment
chooses neither the code the worker runs (the external backend is a saved block; a class path in
a payload is refused and nothing is built) nor the files it reads: a source outside the staging
block's roots, directly or through a symlink, is refused naming the field before any file of it
is opened — proved with a Megatron `.metadata` pickle whose unpickling would create a marker.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from prefect import get_client

from blocks import FleetBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.events import BlockNames, point_event, post_events
from pinned_eval.points import PointRequest, SnapshotSource
from pinned_eval.sinks import JsonlSink
from tests.conftest import free_port
from tests.deploykit import Deployed, runs_of_deployment, wait_for
from tests.fast.test_sec_payloads import plant_megatron_checkpoint
from tests.pointkit import PointEnv, save_point_blocks, write_step_snapshot

pytestmark = pytest.mark.e2e
PLANTED = "tests.sec_backends:PlantedBackend"


def confined_env(tmp_path: Path) -> tuple[PointEnv, Path]:
    """Blocks of a point whose staging block declares one source root, `<tmp>/allowed`; the fleet
    is never reached (every point here is refused or external)."""
    dead = [f"http://127.0.0.1:{free_port()}"]
    env = save_point_blocks(tmp_path, FleetBlock(name="sec", mode="attach", engine_urls=dead, router_url=dead[0]))
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    StagingBlock(root=str(env.staging_root), source_roots=[str(allowed)]).save(env.blocks["staging"], overwrite=True)
    return env, allowed


def _final(flow_run_id: object):  # type: ignore[no-untyped-def]
    def read():  # type: ignore[no-untyped-def]
        with get_client(sync_client=True) as c:
            fr = c.read_flow_run(flow_run_id)  # type: ignore[arg-type]
        return fr if fr.state and fr.state.is_final() else None

    return wait_for(read, 180, f"flow run {flow_run_id} to finish", interval_s=0.5)


# ---------------------------------------------------------------------------- sources (in-process flow runs)


@pytest.mark.parametrize("case", ["outside", "symlink_inside_root", "hf_base_outside", "etc"])
def test_a_source_outside_the_roots_is_refused_naming_the_field_and_never_unpickled(
    prefect_server: str, tiny_model: Path, tmp_path: Path, case: str
) -> None:
    env, allowed = confined_env(tmp_path)
    marker = tmp_path / "unpickled"
    planted = plant_megatron_checkpoint(tmp_path / "elsewhere" / "ckpt", marker)
    (allowed / "link").symlink_to(planted)
    inside = plant_megatron_checkpoint(allowed / "ckpt", marker)  # never read: its hf_base is refused first
    source, field = {
        "outside": ({"kind": "megatron", "path": str(planted), "hf_base": str(tiny_model)}, "source.path"),
        "symlink_inside_root": (
            {"kind": "megatron", "path": str(allowed / "link"), "hf_base": str(tiny_model)}, "source.path"
        ),
        "hf_base_outside": ({"kind": "megatron", "path": str(inside), "hf_base": str(tiny_model)}, "source.hf_base"),
        "etc": ({"kind": "hf", "path": "/etc", "require_marker": False}, "source.path"),
    }[case]
    state = eval_point(**env.params(5, source=source), return_state=True)
    assert state.is_failed(), state
    refused = source["hf_base"] if field == "source.hf_base" else source["path"]
    shown = "" if os.path.realpath(refused) == refused else f" (resolves to {os.path.realpath(refused)!r})"
    roots = ", ".join(StagingBlock.load(env.blocks["staging"]).all_source_roots())
    assert state.message == (  # the user's words: the field, the path, the roots, the key that adds one
        f"{field}: {refused!r}{shown} is outside the source roots of the point's staging block ({roots}); "
        "nothing was read. Put the snapshot under one of them, or add a root with the staging block's "
        "`source_root` key (pinned-eval.yaml, `pinned-eval block apply`)"
    ), state.message
    [row] = JsonlSink(env.jsonl).read(env.run)  # recorded at its step, like any failed point
    assert (row.step, row.state, row.reason, row.metrics["eval/skipped_crashed"]) == (5, "failed", "crashed", 1)
    assert not marker.exists(), "a pickle outside the source roots was loaded"


# ---------------------------------------------------------------------------- backends (in-process flow run)


def test_a_saved_backend_block_runs_and_its_secret_stays_out_of_parameters(
    prefect_server: str, tiny_model: Path, tmp_path: Path
) -> None:
    from blocks import ExternalBackendBlock

    env, allowed = confined_env(tmp_path)
    snap = write_step_snapshot(tiny_model, str(allowed / "step_7"))
    record, secret = tmp_path / "record.json", f"key-{uuid.uuid4().hex}"
    block = f"sec-{uuid.uuid4().hex[:8]}"
    ExternalBackendBlock(
        backend="tests.sec_backends:RecordingBackend", options={"record": str(record)},
        secret_options={"api_key": secret},
    ).save(block)
    state = eval_point(**env.params(7, source={"kind": "hf", "path": snap}, posture="external", backend_block=block),
                       return_state=True)
    assert state.is_completed() and state.name == "Completed", state.message
    assert json.loads(record.read_text()) == {"record": str(record), "api_key": secret}
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(state.state_details.flow_run_id)
    assert fr.parameters["backend_block"] == block and secret not in json.dumps(fr.parameters)
    assert {(r.step, r.state, r.metrics[f"eval/{r.dataset}"]) for r in JsonlSink(env.jsonl).read(env.run)} == {
        (7, "measured", 1.0)
    }


# ---------------------------------------------------------------------------- the deployed path (event, REST)


def _attack_payload(env: PointEnv, step: int, source: dict, **extra: object) -> dict:
    """An event as an attacker sends it: a valid request's payload plus their own fields."""
    req = PointRequest(run=env.run, step=step, source=SnapshotSource.model_validate(source))
    event = point_event(req, BlockNames(**env.blocks))
    event["payload"].update(extra)
    return event


def test_events_naming_a_class_path_or_a_foreign_source_run_nothing(
    deployed: Deployed, tiny_model: Path, tmp_path: Path
) -> None:
    env, allowed = confined_env(tmp_path)
    marker = tmp_path / "built"
    snap = write_step_snapshot(tiny_model, str(allowed / "step_1"))
    pickled = tmp_path / "unpickled"
    planted = plant_megatron_checkpoint(tmp_path / "elsewhere" / "ckpt", pickled)
    StagingBlock(root=str(env.staging_root), source_roots=[str(allowed), str(tiny_model)]).save(
        env.blocks["staging"], overwrite=True
    )
    code = _attack_payload(env, 1, {"kind": "hf", "path": snap}, posture="external", backend=PLANTED,
                           backend_options={"marker": str(marker)})
    path = _attack_payload(env, 2, {"kind": "megatron", "path": str(planted), "hf_base": str(tiny_model)})
    post_events(deployed.api_url, [code, path])
    runs = wait_for(lambda: len(r := runs_of_deployment(deployed.deployment_id, env.run)) == 2 and r, 60,
                    "the triggered runs")
    done = {r.parameters["step"]: _final(r.id) for r in runs}
    assert done[1].state.is_failed() and "backend_block" in str(done[1].state.message), done[1].state.message
    assert "backend" not in done[1].parameters and "backend_options" not in done[1].parameters
    assert done[2].state.is_failed(), done[2].state
    assert str(done[2].state.message).startswith(f"source.path: {str(planted)!r} is outside the source roots of "
                                                 "the point's staging block ("), done[2].state.message
    assert "SourceOutsideRoots" not in str(done[2].state.message)
    assert not marker.exists(), "the payload's class was built by the worker"
    assert not pickled.exists(), "the payload's pickle was loaded by the worker"


def test_a_created_flow_run_naming_a_class_path_is_refused(
    deployed: Deployed, tiny_model: Path, tmp_path: Path
) -> None:
    env, allowed = confined_env(tmp_path)
    marker = tmp_path / "built"
    snap = write_step_snapshot(tiny_model, str(allowed / "step_3"))
    params = env.params(3, source={"kind": "hf", "path": snap}, posture="external", backend=PLANTED,
                        backend_options={"marker": str(marker)})
    with get_client(sync_client=True) as c:
        fr = c.create_flow_run_from_deployment(deployed.deployment_id, parameters=params)
    done = _final(fr.id)
    # the server stores any parameters; the flow-run process refuses them before the flow starts
    assert done.state.is_crashed(), done.state
    [refusal] = [m for m in _log_messages(fr.id) if "SignatureMismatchError" in m]
    assert "'backend', 'backend_options']" in refusal, refusal
    assert not marker.exists(), "the parameters' class was built by the worker"


def _log_messages(flow_run_id: object) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as c:
        logs = c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))  # type: ignore[list-item]
    return [log.message for log in logs]
