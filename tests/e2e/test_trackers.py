"""Real eval points into MLflow and TensorBoard, beside the training run (real Prefect server, CPU
fleet, a real `mlflow server` on 127.0.0.1, TensorBoard's own event-file reader).

The trainer has an MLflow run and a TensorBoard log directory of its own, each holding a training
curve; the sinks block names both. Points at steps 3 and 5 are measured: every metric of their JSONL
rows is in the trainer's MLflow run at the point's step and in `<logdir>/eval`, values equal exactly
(step 5's MLflow export sent by a deliverer from an outbox, as under a worker), and the trainer's
own curve and event file are untouched. Then the MLflow server is killed (by its process group): the
point at step 7 is still measured, its rows carry the MLflow error (`sink_errors`,
`eval/sink_failed_mlflow`), and TensorBoard still got it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from blocks import FleetBlock, SinksBlock, StagingBlock
from flows.eval_point import eval_point
from pinned_eval.polling import poll_until
from pinned_eval.sinks import Ledger, mlflow_key
from pinned_eval.sinks.delivery import Deliverer
from pinned_eval.sinks.outbox import OUTBOX_ENV, Outbox
from pinned_eval.sinks.tensorboard import EVAL_SUBDIR
from tests.mlflow_server import MlflowServer, served
from tests.pointkit import CpuFleet, PointEnv, save_point_blocks, write_step_snapshot
from tests.tensorboard_events import scalars

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    yield from served(tmp_path_factory)


def _point(env: PointEnv, step: int, tiny: Path) -> str:
    dest = StagingBlock.load(env.blocks["staging"]).staging().path_for(env.run, step)
    write_step_snapshot(tiny, dest)
    state = eval_point(**env.params(step, source={"kind": "staged", "path": dest}), return_state=True)  # type: ignore[arg-type]
    assert state.is_completed() and state.name == "Completed", state.message
    return str(state.message)


def _merged(env: PointEnv, step: int) -> dict[str, float]:
    rows = [r for r in Ledger(env.jsonl).read(env.run) if r.step == step]
    assert sorted(r.dataset or "" for r in rows) == ["arith_add", "arith_sub"]
    assert all(r.state == "measured" for r in rows)
    return {k: v for r in rows for k, v in r.metrics.items() if not k.startswith("eval/sink_failed_")}


def test_points_land_in_the_trainers_mlflow_run_and_logdir_and_a_dead_server_leaves_them_measured(
    prefect_server: str, cpu_fleet: CpuFleet, tiny_model: Path, tmp_path: Path, mlflow_server: MlflowServer
) -> None:
    from mlflow import MlflowClient
    from tensorboard.summary import Writer

    client = MlflowClient(tracking_uri=mlflow_server.url)
    trainer = client.create_run(client.create_experiment(f"rl-{uuid.uuid4().hex[:6]}"), run_name="train")
    client.log_metric(trainer.info.run_id, "train/loss", 2.5, step=1)
    logdir = tmp_path / "tb"
    trainer_writer = Writer(str(logdir))  # the trainer's own event file, in the directory it names
    trainer_writer.add_scalar("train/loss", 2.5, step=1)
    trainer_writer.close()

    fleet = FleetBlock(name=f"f{uuid.uuid4().hex[:6]}", mode="launch", state_file=str(cpu_fleet.state_file))
    env = save_point_blocks(tmp_path, fleet, keep_snapshots=0)
    SinksBlock(jsonl_path=str(env.jsonl), mlflow_tracking_uri=mlflow_server.url, mlflow_run_id=trainer.info.run_id,
               tensorboard_dir=str(logdir)).save(env.blocks["sinks"], overwrite=True)

    assert "sink failed" not in _point(env, 3, tiny_model)
    outbox = Outbox(tmp_path / "outbox")  # step 5 as under a worker: MLflow sent by a deliverer, off the point
    stop, deliverer = threading.Event(), Deliverer(outbox, poll_s=0.05)
    serving = threading.Thread(target=deliverer.run, args=(stop,), daemon=True)
    serving.start()
    try:
        poll_until(outbox.served, timeout_s=10, interval_s=0.05, what="the deliverer to serve")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(OUTBOX_ENV, str(outbox.root))
            assert "sink failed" not in _point(env, 5, tiny_model)
        poll_until(lambda: deliverer.delivered == 1, timeout_s=60, interval_s=0.1, what="the deliverer to send")
    finally:
        stop.set()
        serving.join(timeout=60)
    measured = {step: _merged(env, step) for step in (3, 5)}
    assert all(not r.sink_errors for r in Ledger(env.jsonl).read(env.run))

    run = client.get_run(trainer.info.run_id)
    assert run.info.status == "RUNNING"  # a secondary writer: the trainer's run is left as it was
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] for k in run.data.metrics}
    expected = {mlflow_key(k): [(s, measured[s][k]) for s in (3, 5)] for k in measured[3]}
    assert history == {**expected, "train/loss": [(1, 2.5)]}

    mlflow_server.kill()
    message = _point(env, 7, tiny_model)
    assert "; sink failed: mlflow (MlflowException: " in message, message
    rows = [r for r in Ledger(env.jsonl).read(env.run) if r.step == 7]
    for r in rows:
        assert sorted(r.sink_errors) == ["mlflow"]
        assert r.sink_errors["mlflow"].startswith("MlflowException: "), r.sink_errors
        assert r.metrics["eval/sink_failed_mlflow"] == 1
    measured[7] = _merged(env, 7)

    eval_scalars = {tag: sorted(points) for tag, points in scalars(logdir / EVAL_SUBDIR).items()}
    assert eval_scalars == {k: [(s, measured[s][k]) for s in (3, 5, 7)] for k in measured[3]}
    assert {tag: [(s, round(v, 6)) for s, v in pts] for tag, pts in scalars(logdir).items()} == {
        "train/loss": [(1, 2.5)]
    }  # the trainer's file, read alone in its directory, is untouched
