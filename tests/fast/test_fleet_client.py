"""Fleet client logic against in-process SGLang-protocol servers (pin, verify, health, revive, generate)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from pinned_eval.fleet import (
    FleetClient,
    FleetConfig,
    FleetUnhealthy,
    GenerateRejected,
    GenerationAborted,
    HealthState,
    NotPinned,
    PinViolation,
    SamplingParams,
    WeightVersionMismatch,
)
from pinned_eval.fleet.generate import build_generate_body
from pinned_eval.skips import EvalSkipped
from tests.fast.test_fleet_fake import FakeEngine, ServedFake

FAST = FleetConfig(
    dead_after_s=30.0, alive_timeout_s=5.0, poll_interval_s=0.05, health_timeout_s=5.0, router_ready_timeout_s=5.0
)


@pytest.fixture
def serve() -> Iterator[list[ServedFake]]:
    servers: list[ServedFake] = []
    yield servers
    for s in servers:
        s.close()


def start(servers: list[ServedFake], **knobs: object) -> ServedFake:
    served = ServedFake(FakeEngine(**knobs))  # type: ignore[arg-type]
    servers.append(served)
    return served


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    path = tmp_path / "step_5"
    path.mkdir()
    return path


class RestartingReviver:
    """Records revivals and brings the engine back on the same port (what LaunchedFleet does for real)."""

    def __init__(self, servers: list[ServedFake], urls: list[str]) -> None:
        self.servers, self.urls, self.revived = servers, urls, []

    def manages(self, url: str) -> bool:
        return url in self.urls

    def revive(self, url: str) -> None:
        self.revived.append(url)
        for s in list(self.servers):
            if s.url == url:
                s.close()
                self.servers.remove(s)
        self.servers.append(ServedFake(FakeEngine(), port=int(url.rsplit(":", 1)[1])))


async def test_probe_reads_the_live_version_and_path(serve: list[ServedFake]) -> None:
    a = start(serve, weight_version="3", model_path="/snap/a")
    async with FleetClient([a.url + "/"], config=FAST) as client:
        info = await client.probe(a.url)
    assert (info.url, info.weight_version, info.model_path) == (a.url, "3", "/snap/a")


async def test_probe_falls_back_to_get_model_info_on_404(serve: list[ServedFake]) -> None:
    a = start(serve, old_api=True, weight_version="old")
    async with FleetClient([a.url], config=FAST) as client:
        assert (await client.probe(a.url)).weight_version == "old"
    assert [p for m, p, _, _ in a.fake.requests] == ["/model_info", "/get_model_info"]


async def test_pin_loads_every_engine_then_reads_every_engine_back(serve: list[ServedFake], snapshot: Path) -> None:
    a, b = start(serve), start(serve)
    async with FleetClient([a.url, b.url], config=FAST) as client:
        result = await client.pin(snapshot, 5)
        views = await client.fleet_health()
    assert result.weight_version == "5" and result.attempts == 1
    assert {e.url for e in result.engines} == {a.url, b.url}
    assert all(e.weight_version == "5" and e.model_path == str(snapshot) for e in result.engines)
    for fake in (a.fake, b.fake):
        assert fake.calls("POST", "/update_weights_from_disk") == [
            {"model_path": str(snapshot), "weight_version": "5", "abort_all_requests": True, "flush_cache": True}
        ]
        paths = [p for _, p, _, _ in fake.requests]
        assert paths.index("/update_weights_from_disk") < len(paths) - 1 - paths[::-1].index("/model_info")
    assert client.pinned_version == "5"
    assert all(v.serving and v.verified_version == "5" for v in views)


async def test_pin_requires_every_engine_to_match_and_retries_once(serve: list[ServedFake], snapshot: Path) -> None:
    honest, liar = start(serve), start(serve, lie_version="999")
    async with FleetClient([honest.url, liar.url], config=FAST) as client:
        with pytest.raises(PinViolation) as err:
            await client.pin(snapshot, "5")
        assert client.pinned_version is None
        liar_view = await client.health(liar.url)
    assert isinstance(err.value, EvalSkipped) and err.value.reason == "pin_violation"
    assert err.value.attempts == 2
    assert len(honest.fake.calls("POST", "/update_weights_from_disk")) == 2
    assert len(liar.fake.calls("POST", "/update_weights_from_disk")) == 2
    bad = [c for c in err.value.checks if not c.ok]
    assert [(c.url, c.weight_version) for c in bad] == [(liar.url, "999")]
    assert "weight_version '999'" in bad[0].problem
    assert not liar_view.weights_known and not liar_view.serving


async def test_pin_checks_the_model_path_too(serve: list[ServedFake], snapshot: Path, tmp_path: Path) -> None:
    a = start(serve, lie_path=str(tmp_path))  # right version label, other weights on disk
    async with FleetClient([a.url], config=FAST) as client:
        with pytest.raises(PinViolation) as err:
            await client.pin(snapshot, "6")
    assert err.value.checks[0].weight_version == "6"
    assert "reads back model_path" in err.value.checks[0].problem


async def test_failed_load_leaves_weights_unknown_until_a_good_pin(
    serve: list[ServedFake], snapshot: Path, tmp_path: Path
) -> None:
    a, b = start(serve), start(serve)
    async with FleetClient([a.url, b.url], config=FAST) as client:
        await client.pin(snapshot, "5")
        with pytest.raises(PinViolation) as err:
            await client.pin(tmp_path / "missing", "6")
        assert {c.load.error for c in err.value.checks} == {"rejected"}
        assert {c.load.status_code for c in err.value.checks} == {400}
        views = await client.fleet_health()
        assert all(v.state is HealthState.UP and not v.weights_known and not v.serving for v in views)
        with pytest.raises(NotPinned):
            await client.generate("x")
        await client.pin(snapshot, "7")
        assert all(v.serving for v in await client.fleet_health())


async def test_engine_refusing_unknown_weights_is_loadable_not_dead(
    serve: list[ServedFake], snapshot: Path, tmp_path: Path
) -> None:
    a = start(serve, refuse_unknown_weights=True)
    config = FAST.model_copy(update={"dead_after_s": 0.0, "alive_timeout_s": 0.5})  # no waiting, no revival
    async with FleetClient([a.url], config=config) as client:
        with pytest.raises(PinViolation):
            await client.pin(tmp_path / "missing", "6")
        view = await client.health(a.url)
        assert (view.state, view.loadable, view.status_code) == (HealthState.BUSY, True, 503)
        assert (await client.pin(snapshot, "7")).weight_version == "7"
        assert (await client.health(a.url)).serving


async def test_dead_launched_engine_is_revived_before_the_pin(serve: list[ServedFake], snapshot: Path) -> None:
    a, b = start(serve), start(serve)
    reviver = RestartingReviver(serve, [a.url, b.url])
    b.close()
    serve.remove(b)
    async with FleetClient([a.url, b.url], config=FAST, reviver=reviver) as client:
        result = await client.pin(snapshot, "5")
    assert reviver.revived == [b.url] and result.revived == [b.url]
    revived_fake = next(s for s in serve if s.url == b.url).fake
    assert revived_fake.weight_version == "5"


async def test_dead_engine_not_launched_by_us_is_an_unhealthy_fleet(serve: list[ServedFake], snapshot: Path) -> None:
    a, b = start(serve), start(serve)
    b.close()
    serve.remove(b)
    async with FleetClient([a.url, b.url], config=FAST) as client:
        with pytest.raises(FleetUnhealthy) as err:
            await client.pin(snapshot, "5")
    assert err.value.reason == "unhealthy" and err.value.urls == [b.url]
    assert a.fake.calls("POST", "/update_weights_from_disk") == []


async def test_engine_is_busy_not_dead_while_its_load_runs(serve: list[ServedFake], snapshot: Path) -> None:
    a = start(serve, load_delay_s=2.0)
    async with FleetClient([a.url], config=FAST) as client:
        pin = asyncio.create_task(client.pin(snapshot, "5"))
        while not a.fake.calls("POST", "/update_weights_from_disk"):
            await asyncio.sleep(0.02)
        a.fake.health_status = 503  # what SGLang's /health does behind the writer lock
        health_calls = len(a.fake.calls("GET", "/health"))
        view = await client.health(a.url)
        assert view.state is HealthState.BUSY and "loading" in view.detail
        assert len(a.fake.calls("GET", "/health")) == health_calls  # /health is not asked during a load
        a.fake.health_status = 200
        assert (await pin).weight_version == "5"


async def test_503_is_busy_within_the_deadline_and_dead_after_it(serve: list[ServedFake]) -> None:
    a = start(serve, health_status=503)
    config = FAST.model_copy(update={"dead_after_s": 0.3})
    async with FleetClient([a.url], config=config) as client:
        first = await client.health(a.url)
        assert first.state is HealthState.BUSY and "/model_info answers" in first.detail
        await asyncio.sleep(0.35)
        assert (await client.health(a.url)).state is HealthState.DEAD
        a.fake.health_status = 200
        assert (await client.health(a.url)).state is HealthState.UP
        a.fake.health_status = 503  # the clock restarts after a good probe
        assert (await client.health(a.url)).state is HealthState.BUSY


async def test_paused_engine_is_busy_and_health_is_not_asked(serve: list[ServedFake]) -> None:
    a = start(serve)
    async with FleetClient([a.url], config=FAST) as client:
        await client.pause_generation("retract")
        a.fake.health_status = 503
        assert (await client.health(a.url)).state is HealthState.BUSY
        assert a.fake.calls("GET", "/health") == []
        assert a.fake.calls("POST", "/pause_generation") == [{"mode": "retract"}]
        a.fake.health_status = 200
        await client.continue_generation()
        assert (await client.health(a.url)).state is HealthState.UP


async def test_busy_engines_past_the_alive_timeout_make_the_fleet_unhealthy(
    serve: list[ServedFake], snapshot: Path
) -> None:
    a = start(serve, health_status=503)
    config = FAST.model_copy(update={"alive_timeout_s": 0.3})
    async with FleetClient([a.url], config=config) as client:
        with pytest.raises(FleetUnhealthy, match="not up after"):
            await client.pin(snapshot, "5")
    assert a.fake.calls("POST", "/update_weights_from_disk") == []


async def test_persisting_503_on_a_launched_engine_gets_it_revived(serve: list[ServedFake], snapshot: Path) -> None:
    a = start(serve, health_status=503)
    reviver = RestartingReviver(serve, [a.url])
    config = FAST.model_copy(update={"dead_after_s": 0.2})
    async with FleetClient([a.url], config=config, reviver=reviver) as client:
        result = await client.pin(snapshot, "5")
    assert reviver.revived == [a.url] and result.weight_version == "5"


async def test_bearer_tokens_follow_sglang_rules(serve: list[ServedFake], snapshot: Path) -> None:
    a = start(serve, api_key="data", admin_api_key="admin")
    config = FAST.model_copy(update={"api_key": "data", "admin_api_key": "admin"})
    async with FleetClient([a.url], config=config) as client:
        await client.pin(snapshot, "5")
    async with FleetClient([a.url], a.url, config=config) as client:
        await client.generate("hi", expected_version="5")
    auth = {p: h.get("authorization") for m, p, _, h in a.fake.requests}
    assert auth["/update_weights_from_disk"] == "Bearer admin"
    assert auth["/model_info"] == auth["/generate"] == "Bearer data"
    async with FleetClient([a.url], config=FAST.model_copy(update={"api_key": "data"})) as client:
        with pytest.raises(PinViolation) as err:
            await client.pin(snapshot, "6")
    assert err.value.checks[0].load.status_code == 401 and err.value.checks[0].load.error == "http"


async def test_generate_sends_one_prompt_with_sglang_names(serve: list[ServedFake]) -> None:
    router = start(serve, weight_version="5")
    async with FleetClient([router.url], router.url, config=FAST) as client:
        sp = SamplingParams(max_new_tokens=4, temperature=0.0, sampling_seed=11, stop=["\n"])
        result = await client.generate("2+2=", sampling_params=sp, rid="q1", expected_version="5")
        await client.generate(input_ids=[1, 2, 3], expected_version="5")
    assert result.weight_version == "5" and result.truncated and result.attempts == 1
    assert router.fake.calls("POST", "/generate") == [
        {
            "text": "2+2=",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "stop": ["\n"], "sampling_seed": 11},
            "rid": "q1",
        },
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 128, "temperature": 1.0}},
    ]


async def test_aborted_responses_are_retried_with_fresh_rids(serve: list[ServedFake]) -> None:
    router = start(serve, weight_version="5", abort_first=2)
    async with FleetClient([router.url], router.url, config=FAST) as client:
        result = await client.generate("x", rid="q", expected_version="5")
    assert result.attempts == 3 and result.finish_type == "length"
    assert [b["rid"] for b in router.fake.calls("POST", "/generate")] == ["q", "q.retry1", "q.retry2"]


async def test_router_without_healthy_workers_is_asked_again_boundedly(serve: list[ServedFake]) -> None:
    router = start(serve, weight_version="5", unavailable_first=1)
    async with FleetClient([router.url], router.url, config=FAST) as client:
        assert (await client.generate("x", expected_version="5")).attempts == 2
        router.fake.unavailable_first = 100
        client._generator.unavailable_retries = 0  # type: ignore[union-attr]
        with pytest.raises(GenerateRejected) as err:
            await client.generate("x", expected_version="5")
    assert err.value.status_code == 503


async def test_aborts_past_the_bound_raise(serve: list[ServedFake]) -> None:
    router = start(serve, weight_version="5", abort_first=100)
    async with FleetClient([router.url], router.url, config=FAST.model_copy(update={"abort_retries": 2})) as c:
        with pytest.raises(GenerationAborted) as err:
            await c.generate("x", expected_version="5")
    assert err.value.attempts == 3 and len(router.fake.calls("POST", "/generate")) == 3


@pytest.mark.parametrize(
    ("knobs", "got"),
    [
        ({"generate_version": "4"}, "4"),
        ({"spans": [{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 2}]}, "5"),
    ],
)
async def test_another_weight_version_in_a_response_raises(
    serve: list[ServedFake], knobs: dict[str, object], got: str
) -> None:
    router = start(serve, weight_version="5", **knobs)
    async with FleetClient([router.url], router.url, config=FAST) as client:
        with pytest.raises(WeightVersionMismatch) as err:
            await client.generate("x", expected_version="5")
    assert err.value.expected == "5" and err.value.got == got


async def test_request_concurrency_is_bounded_per_fleet(serve: list[ServedFake]) -> None:
    router = start(serve, weight_version="5", generate_delay_s=0.5)
    for limit, bounded in ((3, True), (8, False)):
        router.fake.max_in_flight = 0
        config = FAST.model_copy(update={"max_concurrency": limit})
        async with FleetClient([router.url], router.url, config=config) as client:
            await asyncio.gather(*(client.generate(f"p{i}", expected_version="5") for i in range(10)))
        if bounded:
            assert router.fake.max_in_flight <= 3
        else:
            assert router.fake.max_in_flight > 3


async def test_router_refusal_is_a_typed_error(serve: list[ServedFake]) -> None:
    nothing = start(serve)
    async with FleetClient([nothing.url], nothing.url + "/nope", config=FAST) as client:
        with pytest.raises(GenerateRejected) as err:
            await client.generate("x", expected_version="5")
    assert err.value.status_code == 404


def test_sampling_params_reject_unknown_and_router_dropped_keys() -> None:
    for key in ("seed", "max_tokens", "logit_bias", "n"):
        with pytest.raises(ValidationError, match=key):
            SamplingParams.model_validate({key: 1})
    assert SamplingParams(sampling_seed=3).to_wire() == {"max_new_tokens": 128, "temperature": 1.0, "sampling_seed": 3}


def test_generate_body_is_one_prompt_exactly() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_body("a", input_ids=[1])
    with pytest.raises(ValueError, match="exactly one"):
        build_generate_body()
    with pytest.raises(TypeError, match="one string"):
        build_generate_body(["a", "b"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="flat list"):
        build_generate_body(input_ids=[[1], [2]])  # type: ignore[list-item]


def test_model_paths_are_compared_in_one_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pinned_eval.fleet.models import normalize_path, normalize_url

    monkeypatch.chdir(tmp_path)
    assert normalize_path("snap/./step_5/") == str(tmp_path / "snap" / "step_5")
    assert normalize_path("s3://bucket/run/step_5/") == "s3://bucket/run/step_5"
    assert normalize_url("127.0.0.1:30000/") == "http://127.0.0.1:30000"
