"""Property tests of the parsers at the edges: point requests / event payloads, the safetensors
header parser, the dataset loader. Complements tests/fast (fixed cases, file corruptions, loader
round trips): here the input is arbitrary, and the contract is "valid, or refused by name".
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prefect.exceptions import ParameterTypeError
from pydantic import ValidationError

from flows.eval_point import eval_point
from pinned_eval.datasets.loader import DatasetError, EvalSample, load_dataset
from pinned_eval.events import BlockNames, point_event
from pinned_eval.points import PointRequest, SnapshotSource
from pinned_eval.snapshot.check import SnapshotProblem, _Incomplete, _parse_header, check_snapshot
from pinned_eval.suite import DatasetSpec, EvalSuite

FIELDS = set(PointRequest.model_fields)
# what the deployment trigger in prefect.yaml maps into flow parameters
TRIGGER_KEYS = [
    "run",
    "step",
    "source",
    "final",
    "posture",
    "policy",
    "max_in_flight",
    "export_time_seconds",
    "backend_block",
]

_json_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.floats(allow_nan=False), st.text(max_size=20)
)
_json = st.recursive(
    _json_scalar,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=8,
)
_source = st.one_of(
    st.fixed_dictionaries(
        {
            "kind": st.sampled_from(["hf", "staged", "megatron", "state_dict", "zip"]),
            "path": st.sampled_from(["/ckpt/step_1", "", "s3://b/p"]),
        },
        optional={"hf_base": st.sampled_from(["/base", None]), "require_marker": st.booleans(), "extra": _json_scalar},
    ),
    _json,
)
_values: dict[str, Any] = {
    "run": st.one_of(st.sampled_from(["exp42", "a", "Exp", "-x", "a/b", "x" * 64]), st.text(max_size=10)),
    "step": st.one_of(st.integers(-5, 10**9), st.text(max_size=4), st.floats(allow_nan=False)),
    "source": st.one_of(st.none(), _source),
    "final": st.one_of(st.booleans(), _json_scalar),
    "posture": st.one_of(st.sampled_from(["fleet", "shared", "external", "gpu"]), _json_scalar),
    "policy": st.one_of(st.sampled_from(["backpressure", "skip", "drop"]), _json_scalar),
    "max_in_flight": st.one_of(st.integers(-1, 100), _json_scalar),
    "export_time_seconds": st.one_of(st.none(), st.floats(-1, 1e4, allow_nan=False), st.text(max_size=3)),
    "backend_block": st.one_of(st.none(), st.sampled_from(["sglang", "Bad Name", ""]), st.text(max_size=10)),
}
# `backend`/`backend_options` (a class path and options) are no fields: a payload naming them is refused
_payload = st.fixed_dictionaries(
    {}, optional={**_values, "bogus": _json_scalar, "backend": st.sampled_from(["os:system", "x.y:Z"])}
)


def _named(exc: ValidationError, payload: dict[str, Any]) -> bool:
    """Every error names a request field: by location, or (model-level checks) in its message."""
    for err in exc.errors():
        loc = err["loc"]
        if loc and str(loc[0]) in FIELDS | set(payload):
            continue
        if not loc and any(f in err["msg"] for f in FIELDS):
            continue
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(payload=_payload)
def test_point_request_is_valid_or_refused_by_field_name(payload: dict[str, Any]) -> None:
    try:
        req = PointRequest.model_validate(payload)
    except ValidationError as exc:
        assert _named(exc, payload), exc.errors()
        return
    assert (req.step >= 0 and req.source is not None) or req.posture.value == "shared"
    # a valid request becomes an event whose payload is the flow's parameters, accepted as they are
    event = point_event(req, BlockNames())
    assert PointRequest.model_validate({k: v for k, v in event["payload"].items() if k != "blocks"}) == req
    params = {k: event["payload"][k] for k in TRIGGER_KEYS} | event["payload"]["blocks"]
    checked = eval_point.validate_parameters(params)
    assert _flow_request(checked) == req  # what the flow validates through
    assert checked["step"] == req.step and checked["source"] == req.source


def _flow_request(checked: dict[str, Any]) -> PointRequest:
    """The flow's own validation: its parameters as a `PointRequest` (no second validator)."""
    return PointRequest(**{k: v for k, v in checked.items() if k in FIELDS})


_bad = {
    "run": st.sampled_from(["a..b", "a/b", "../x", "", "exp 1", "-x"]),
    "step": st.sampled_from([-1, -100]),
    "posture": st.sampled_from(["gpu", "", 3]),
    "policy": st.sampled_from(["drop", 1]),
    "source": st.sampled_from(
        [
            {"kind": "zip", "path": "/x"},
            {"kind": "hf"},
            {"kind": "state_dict", "path": "/x"},
            {"kind": "hf", "path": "/x", "surprise": 1},
        ]
    ),
}


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(sorted(_bad)), data=st.data())
def test_bad_trigger_parameters_are_refused_naming_the_field(field: str, data: st.DataObject) -> None:
    """What a hand-made event could carry into the flow: refused before the flow body runs."""
    params: dict[str, Any] = {"run": "exp1", "step": 1, "source": {"kind": "hf", "path": "/ckpt"}}
    params[field] = data.draw(_bad[field])
    with pytest.raises((ParameterTypeError, ValueError)) as info:
        _flow_request(eval_point.validate_parameters(params))
    assert field in str(info.value), str(info.value)


# ---- the safetensors header parser -------------------------------------------------------------

_entry = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "BF16", "I8", "Q4", 3]),
        "shape": st.one_of(st.lists(st.integers(-1, 5), max_size=3), _json_scalar),
        "data_offsets": st.one_of(st.lists(st.integers(-2, 200), max_size=3), _json_scalar),
    },
)
_header = st.one_of(
    st.dictionaries(st.text(max_size=6), st.one_of(_entry, _json_scalar), max_size=4),
    st.fixed_dictionaries({"__metadata__": st.one_of(_json, st.fixed_dictionaries({"format": _json_scalar}))}),
    _json,
)


@settings(max_examples=300, deadline=None)
@given(
    raw=st.one_of(
        _header.map(lambda h: json.dumps(h).encode()),
        st.binary(max_size=64),
        st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
    )
)
def test_header_parser_answers_or_names_bad_header(raw: bytes) -> None:
    try:
        header, end = _parse_header("model-00001-of-00001.safetensors", raw)
    except _Incomplete as exc:
        assert exc.problem is SnapshotProblem.BAD_HEADER and "model-00001-of-00001.safetensors" in exc.detail
        return
    assert end == header.data_bytes >= 0


_VALID = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(raw=_VALID, tail=bytes(8), lie=0)  # complete
@example(raw=_VALID, tail=bytes(7), lie=0)  # one byte short
@example(raw=_VALID, tail=bytes(8), lie=1)  # the header length lies
@given(
    raw=st.one_of(_header.map(lambda h: json.dumps(h).encode()), st.binary(max_size=64)),
    tail=st.binary(max_size=32),
    lie=st.integers(-4, 4),
)
def test_single_shard_snapshot_with_any_header_is_checked_not_crashed(raw: bytes, tail: bytes, lie: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "model.safetensors").write_bytes(struct.pack("<Q", max(len(raw) + lie, 0)) + raw + tail)
        result = check_snapshot(str(d), require_marker=False)
        loads = _safetensors_loads(d / "model.safetensors")
    # exactly the reference loaders' verdict: complete iff safetensors itself reads every tensor
    # and transformers would take the file (a `__metadata__` format, when set, is "pt")
    assert result.complete is loads, (result, loads)
    assert (result.problem is None) is result.complete


def _safetensors_loads(path: Path) -> bool:
    """Whether safetensors' own loader reads every tensor of the file and its format is PyTorch's."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            if (f.metadata() or {}).get("format", "pt") != "pt":
                return False
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                f.get_tensor(key)
    except (SafetensorError, ValueError, TypeError, OverflowError):
        return False
    return True


def test_deeply_nested_header_is_a_bad_header(tmp_path: Path) -> None:
    """Regression: a nested-array header used to escape as RecursionError (fixed in check.py)."""
    raw = b"[" * 100_000 + b"]" * 100_000
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    result = check_snapshot(str(tmp_path), require_marker=False)
    assert result.problem is SnapshotProblem.BAD_HEADER


# ---- the dataset loader ------------------------------------------------------------------------


def _resolved(path: Path) -> Any:
    return EvalSuite(datasets=(DatasetSpec(name="ds", path=str(path)),)).resolved()[0]


_line = st.one_of(
    _json.map(json.dumps),
    st.fixed_dictionaries({"prompt": _json, "label": _json}, optional={"meta": _json}).map(json.dumps),
    st.text(max_size=12).filter(lambda s: "\n" not in s and "\r" not in s),
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
)


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(_line, min_size=1, max_size=6))
def test_loader_returns_samples_or_names_the_line(lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        try:
            samples = load_dataset(_resolved(path))
        except DatasetError as exc:
            assert "rows.jsonl" in str(exc)
            assert " line " in str(exc) or "has no rows" in str(exc), str(exc)
            return
    assert all(isinstance(s, EvalSample) and isinstance(s.prompt, str) for s in samples)
    # a label keeps its JSON type: a string or a number, never a bool (miles hands it to rewards typed)
    assert all(isinstance(s.label, str | int | float) and not isinstance(s.label, bool) for s in samples)
    assert [s.index for s in samples] == list(range(len(samples)))


def test_source_refuses_unknown_keys_by_name() -> None:
    with pytest.raises(ValidationError) as info:
        SnapshotSource.model_validate({"kind": "hf", "path": "/x", "pth": "/y"})
    assert info.value.errors()[0]["loc"] == ("pth",)
