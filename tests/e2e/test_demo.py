"""`make demo` end to end, exactly as the README runs it, plus the UI check on its Prefect server.

The demo is held open (PINNED_EVAL_DEMO_HOLD=1) after its table so headless Chromium (Debian's
`chromium`, installed by scripts/ci-services.sh) can look at the UI: its API requires the home's
credential (`<home>/api-auth`), so the UI first shows its login form, and after logging in
with the credential every point's run is listed, and the state badges of a Completed, a Skipped
and a Failed run read so. Then it gets Ctrl-C
(SIGINT; the child starts with SIGINT at its default whatever this process inherited), and
nothing it started may be left running. No browser is a failure, not a skip.

After it exits, its history is still browsable from the same home with no variable exported:
`pinned-eval server up` comes back at the demo's address and `pinned-eval status --run demo`
lists the steps of its table.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from pinned_eval.polling import PollTimeout, poll_until

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
UI_RUN = "uicheck"  # the Skipped and Failed runs the UI check adds next to the demo's Completed ones

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _parse_table(out: str) -> list[dict[str, str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step  state"))
    header = lines[start].split()
    rows = []
    for line in lines[start + 1 :]:
        if not re.match(r"^\d+\s", line):
            break
        values = line.split()
        rows.append(dict(zip(header, values, strict=False)))
    return rows


def _descendants_mentioning(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            environ = p.info["environ"] or {}
            blob = " ".join(p.info["cmdline"] or []) + " ".join(f"{k}={v}" for k, v in environ.items())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if marker in blob and p.pid != os.getpid():
            found.append(p)
    return found


@pytest.mark.ui
@pytest.mark.timeout(2400)
def test_make_demo_climbs_pins_every_point_shows_in_the_ui_and_leaves_nothing_running(tmp_path: Path) -> None:
    if not CHROMIUM:
        pytest.fail("no browser: the UI check needs Debian's chromium (scripts/ci-services.sh installs it)")
    env = dict(os.environ, PINNED_EVAL_HOME=str(tmp_path), PINNED_EVAL_DEMO_HOLD="1")
    proc = subprocess.Popen(
        ["make", "demo"], cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not what a nohup'd pytest inherited
    )
    out: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if line.startswith("Prefect UI:"):
                ready.set()

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    try:
        assert ready.wait(1800), "the demo printed no table within 30 minutes:\n" + "".join(out[-40:])
        text = "".join(out)
        ui = re.search(r"Prefect UI: (\S+)", text).group(1)  # type: ignore[union-attr]
        rows = _parse_table(text)
        # backpressure (the demo's default): every point of steps 0, 100, ..., 700 is measured
        assert [(int(r["step"]), r["state"]) for r in rows] == [(s, "measured") for s in range(0, 701, 100)], text
        measured = rows
        for r in measured:
            assert float(r["weight_version"]) == int(r["step"]), r
        first, last = measured[0], measured[-1]
        # its end: the examples that flipped between the last two points, and where their samples are
        samples = tmp_path / "demo" / "results" / "demo" / "step_00000700" / "samples.parquet"
        assert "run demo: step 600 (A) vs step 700 (B)" in text and f"samples of step 700: {samples}" in text, text
        assert samples.is_file()
        assert float(last["arith_add"]) >= float(first["arith_add"]) + 0.2, f"no visible climb:\n{text}"
        auth_file = tmp_path / "api-auth"  # the home's: the demo runs on the home's stack
        _add_skipped_and_failed_runs(ui.removesuffix("/runs") + "/api", tmp_path, auth_file)
        _check_ui(ui, [int(r["step"]) for r in rows], tmp_path / "ui-flow-runs.png", auth_file)
    finally:
        demo_procs = psutil.Process(proc.pid).children(recursive=True)  # make's `pinned-eval demo`
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches make and the demo alike
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        _, alive = psutil.wait_procs(demo_procs, timeout=180)  # make may exit before the demo's cleanup
        assert not alive, f"the demo did not exit after Ctrl-C: {alive}"
        pumping.join(30)  # the rest of its output
    # make dies of the Ctrl-C (or reports "Interrupt", exit 2); the demo itself must have cleaned up
    assert proc.returncode in (0, 2, 130, -signal.SIGINT), "".join(out[-40:])
    assert "stopping the Prefect server and worker" in "".join(out), "".join(out[-40:])
    with contextlib.suppress(PollTimeout):  # processes already signalled may take a moment to go
        poll_until(lambda: not _descendants_mentioning(str(tmp_path)), timeout_s=30, interval_s=0.2, what="")
    left = _descendants_mentioning(str(tmp_path))
    assert not left, f"left running: {[(p.pid, p.name()) for p in left]}"
    _check_history_after_exit(tmp_path, ui, {int(r["step"]): r["state"] for r in rows})


def _check_history_after_exit(home: Path, ui: str, table: dict[int, str]) -> None:
    """The README's next step, as a new user types it: no Prefect variable exported, the home only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PINNED_EVAL_"))}
    env["PINNED_EVAL_HOME"] = str(home)

    def pinned_eval(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)

    up = pinned_eval("server", "up")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"Prefect UI: {ui.removesuffix('/runs')} " in up.stdout, (ui, up.stdout)  # the same address
        status = pinned_eval("status", "--run", "demo", "--json")
        assert status.returncode == 0, status.stderr
        points = json.loads(status.stdout)["points"]
        assert {p["step"]: p["outcome"] for p in points} == table
    finally:
        down = pinned_eval("server", "down")
    assert down.returncode == 0 and down.stdout.startswith("stopped: server"), down.stdout + down.stderr
    left = _descendants_mentioning(str(home))
    assert not left, f"left running: {[(p.pid, p.name()) for p in left]}"


def _add_skipped_and_failed_runs(api: str, tmp_path: Path, auth_file: Path) -> None:
    """Through the product on the demo's server (the trainer's credential from its file): step 1
    is a trainer-side skip (its in-loop export fails), step 2 a point the flow rejects (external
    posture without a backend) → Failed."""
    from app.demo.run import BLOCKS
    from pinned_eval.points import SnapshotSource
    from pinned_eval.settings import PrefectApiSettings
    from trainer_integration.client import EvalClient

    def broken_export(step: int, dest: str) -> None:
        raise OSError("disk full (UI check)")

    settings = PrefectApiSettings(PREFECT_API_AUTH_STRING=None, PINNED_EVAL_API_AUTH_FILE=auth_file)
    with EvalClient(UI_RUN, api, staging_root=tmp_path / "ui-staging", spool_dir=tmp_path / "ui-spool",
                    settings=settings, blocks=BLOCKS) as client:  # the demo's blocks
        assert client.dispatch(1, export=broken_export).action == "skipped_export_failed"
        deployment = client.rest.deployment_id("eval-point", "eval-point")
        params = {"run": UI_RUN, "step": 2, "posture": "external", **BLOCKS.model_dump(),
                  "source": SnapshotSource(kind="hf", path=str(tmp_path), require_marker=False).model_dump(mode="json")}
        resp = client.rest.create_flow_run(deployment, {"name": f"{UI_RUN}/step-2", "parameters": params,
                                                        "tags": [f"run:{UI_RUN}", "step:2"]})
        resp.raise_for_status()
        assert client.deliverer.flush(60), client.deliverer.last_error
        assert client.wait_for(1, 60).state == "skipped"
        assert client.wait_for(2, 180).state in ("failed", "crashed")


def _check_ui(ui: str, steps: list[int], screenshot: Path, auth_file: Path) -> None:
    from playwright.sync_api import Page, sync_playwright

    def badge(page: Page, name: str) -> str:
        item = page.locator(".state-list-item__content").filter(has=page.get_by_text(name, exact=True))
        return item.locator(".state-badge").first.inner_text().strip()

    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(screenshot.parent / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1400, "height": 900},
        )
        try:
            page = browser.new_page()
            page.goto(ui)
            password = page.get_by_placeholder("admin:pass")  # the login form: nothing shows without it
            password.wait_for(timeout=90_000)
            password.fill(auth_file.read_text().strip())
            page.get_by_role("button", name="Login").click()
            page.get_by_text(f"demo/step-{max(steps)}").first.wait_for(timeout=90_000)
            page.get_by_text(f"{UI_RUN}/step-2").first.wait_for(timeout=90_000)
            names = set(page.get_by_text("demo/step-").all_inner_texts())
            page.wait_for_load_state("networkidle")  # task-run counts and pool names load after the list
            badges = {name: badge(page, name) for name in (f"demo/step-{max(steps)}", f"{UI_RUN}/step-1",
                                                           f"{UI_RUN}/step-2")}
            page.screenshot(path=str(screenshot))
        finally:
            browser.close()
    assert {f"demo/step-{s}" for s in steps} <= names, names
    assert badges == {f"demo/step-{max(steps)}": "Completed", f"{UI_RUN}/step-1": "Skipped",
                      f"{UI_RUN}/step-2": "Failed"}, badges
    assert screenshot.stat().st_size > 10_000
