"""Staging behaves the same on a local root and on S3 (moto's server on 127.0.0.1, real S3 protocol).

Every test runs three times, `local`, `s3` and `s3-prefect-aws`, through the same code: write,
check, put, list, materialize, retire / keep-ring, confined delete. Files are corrupted through
fsspec too, so the corruption code is also shared. `s3-prefect-aws` is a staging block saved to
the session's Prefect server naming a prefect-aws `S3Bucket` block (with its `AwsCredentials`),
loaded by name: its `Staging` and options are the ones the block resolves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from blocks import StagingBlock
from pinned_eval.snapshot.check import SnapshotProblem, check_snapshot
from pinned_eval.snapshot.layout import MARKER, join, resolve
from pinned_eval.snapshot.staging import SnapshotIncompleteError, Staging, StagingPathError
from pinned_eval.snapshot.state_dict import export_state_dict
from pinned_eval.snapshot.writer import TensorSpec, write_snapshot
from tests.s3_fixtures import S3Server, s3_server, save_prefect_aws_bucket  # noqa: F401 - fixture
from tests.snapshot_fixtures import logits, named_tensors, perturbed_state_dict, tiny_hf_base

pytestmark = pytest.mark.e2e


@dataclass
class Env:
    kind: str
    staging: Staging
    opts: dict[str, Any] | None
    tmp: Path

    def fs_path(self, url: str, name: str | None = None) -> tuple[Any, str]:
        fs, p = resolve(url, self.opts)
        return fs, (join(fs, p, name) if name else p)

    def read(self, url: str, name: str) -> bytes:
        fs, p = self.fs_path(url, name)
        return fs.cat_file(p)

    def write(self, url: str, name: str, data: bytes) -> None:
        fs, p = self.fs_path(url, name)
        fs.pipe_file(p, data)

    def remove(self, url: str, name: str) -> None:
        fs, p = self.fs_path(url, name)
        fs.rm_file(p)

    def names(self, url: str) -> set[str]:
        fs, p = self.fs_path(url)
        if not fs.exists(p):
            return set()
        return {e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False)}


@pytest.fixture(params=["local", "s3", "s3-prefect-aws"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Env:
    cache = tmp_path / "cache"
    if request.param == "local":
        return Env("local", Staging(str(tmp_path / "stage"), keep_snapshots=2, cache_dir=cache), None, tmp_path)
    server: S3Server = request.getfixturevalue("s3_server")
    bucket = server.make_bucket()
    opts = server.storage_options
    if request.param == "s3-prefect-aws":
        request.getfixturevalue("prefect_server")
        name = save_prefect_aws_bucket(server, bucket, "stage")
        StagingBlock(s3_bucket_block=name, keep_snapshots=2, cache_dir=str(cache)).save(name)
        block = StagingBlock.load(name)
        assert block.root_url() == f"s3://{bucket}/stage" and block.storage_options() == opts
        return Env("s3", block.staging(), block.storage_options(), tmp_path)
    staging = Staging(f"s3://{bucket}/stage", storage_options=opts, keep_snapshots=2, cache_dir=cache)
    return Env("s3", staging, opts, tmp_path)


def _write(env: Env, step: int, run: str = "exp1", seed: int | None = None) -> str:
    url = env.staging.path_for(run, step)
    write_snapshot(named_tensors(seed=step if seed is None else seed), url, max_shard_bytes=30_000,
                   storage_options=env.opts, metadata={"run": run, "step": step})
    return url


def test_write_check_list(env: Env) -> None:
    url = _write(env, 10)
    assert url.startswith("s3://" if env.kind == "s3" else "/")
    r = env.staging.check(url)
    assert r.complete and r.shards == 3
    listed = env.staging.list()
    assert [(s.run, s.step, s.complete, s.retired) for s in listed] == [("exp1", 10, True, False)]
    assert listed[0].path == url and listed[0].mtime > 0


def test_check_problems_are_the_same(env: Env) -> None:
    shard = "model-00002-of-00003.safetensors"
    url = _write(env, 1)
    data = env.read(url, shard)
    env.write(url, shard, data[:-1])
    assert env.staging.check(url).problem is SnapshotProblem.TRUNCATED_SHARD
    env.remove(url, shard)
    assert env.staging.check(url).problem is SnapshotProblem.MISSING_SHARD
    env.write(url, shard, data)
    assert env.staging.check(url).complete

    old_marker = env.read(url, MARKER)
    _write(env, 1, seed=99)  # re-export to the same prefix: same layout, new export id
    env.write(url, MARKER, old_marker)
    assert env.staging.check(url).problem is SnapshotProblem.STALE_MARKER
    env.remove(url, MARKER)
    assert env.staging.check(url).problem is SnapshotProblem.MISSING_MARKER


def test_failed_write_leaves_nothing(env: Env) -> None:
    ts = named_tensors()
    url = env.staging.path_for("exp1", 3)

    def stream():
        yield from ts[:5]
        raise RuntimeError("rank died")

    with pytest.raises(RuntimeError, match="rank died"):
        write_snapshot(stream(), url, plan=[TensorSpec.of(n, t) for n, t in ts], max_shard_bytes=30_000,
                       storage_options=env.opts)
    assert env.names(url) == set()


def test_put_marker_last_and_refuses_incomplete(env: Env) -> None:
    local = env.tmp / "local-snap"
    write_snapshot(named_tensors(), str(local), max_shard_bytes=30_000)
    url = env.staging.put(local, "exp2", 7)
    assert url == env.staging.path_for("exp2", 7)
    assert env.staging.check(url).complete
    assert env.names(url) == {p.name for p in local.iterdir()}

    (local / MARKER).unlink()
    with pytest.raises(SnapshotIncompleteError, match="missing_marker"):
        env.staging.put(local, "exp2", 8)
    assert env.names(env.staging.path_for("exp2", 8)) == set()


def test_materialize_loads_a_real_model(env: Env) -> None:
    base = tiny_hf_base(env.tmp / "base")
    sd = perturbed_state_dict(base, seed=11)
    save_file(sd, str(env.tmp / "w.safetensors"))
    url = env.staging.path_for("exp1", 120)
    export_state_dict(env.tmp / "w.safetensors", base, url, max_shard_bytes=200_000, storage_options=env.opts)
    local = env.staging.materialize(url)
    assert check_snapshot(str(local)).complete
    if env.kind == "local":
        assert str(local) == url
    else:
        assert local.parent == env.tmp / "cache"
    from transformers import AutoModelForCausalLM  # the source weights in the base architecture

    source = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    source.load_state_dict(sd)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = source(input_ids=ids).logits
    torch.testing.assert_close(logits(local), want, rtol=0, atol=0)


def test_materialize_refuses_incomplete(env: Env) -> None:
    url = _write(env, 5)
    env.remove(url, "model-00001-of-00003.safetensors")
    with pytest.raises(SnapshotIncompleteError, match="missing_shard"):
        env.staging.materialize(url)


def test_keep_ring(env: Env) -> None:
    urls = {step: _write(env, step) for step in (10, 20, 30, 40)}
    r = env.staging.retire(urls[10], owned=True)
    assert r.deleted == [] and r.kept == [urls[10]]
    env.staging.retire(urls[20], owned=True)
    r = env.staging.retire(urls[30], owned=True)
    assert r.deleted == [urls[10]] and r.kept == [urls[30], urls[20]]
    # step 40 was never retired (its point still runs): untouched by the ring
    assert [(s.step, s.retired) for s in env.staging.list("exp1")] == [(20, True), (30, True), (40, False)]
    assert env.names(urls[10]) == set()
    assert env.staging.check(urls[40]).complete
    _write(env, 30)  # a rerun re-exports step 30: in use again, so out of the ring
    assert [(s.step, s.retired) for s in env.staging.list("exp1")] == [(20, True), (30, False), (40, False)]


def test_retire_not_owned_never_deletes(env: Env) -> None:
    url = _write(env, 50)
    for keep in (0, 2):
        env.staging.keep_snapshots = keep
        r = env.staging.retire(url, owned=False)
        assert r.deleted == [] and not r.owned
    assert env.staging.check(url).complete
    outside = str(env.tmp / "hf-source")
    assert env.staging.retire(outside, owned=False).deleted == []


def test_keep_zero_deletes_at_once(env: Env) -> None:
    env.staging.keep_snapshots = 0
    url = _write(env, 60)
    r = env.staging.retire(url, owned=True)
    assert r.deleted == [url] and env.names(url) == set() and env.staging.list() == []


def test_delete_is_confined(env: Env) -> None:
    url = _write(env, 70)
    root = env.staging.root
    bad = [f"{root}/../elsewhere", f"{root}/exp1/../../x", root, f"{root}x/exp1/step_00000070"]
    if env.kind == "s3":
        bucket = root.split("/")[2]
        bad += [f"s3://other-{bucket}/stage/exp1/step_00000070", str(env.tmp), "stage/exp1"]
    else:
        bad += ["/etc", "s3://bucket/stage/exp1", "stage/exp1"]
    for path in bad:
        with pytest.raises(StagingPathError):
            env.staging.delete(path)
        with pytest.raises(StagingPathError):
            env.staging.retire(path, owned=True)
    assert env.staging.check(url).complete


def test_materialize_cache_is_bounded(env: Env) -> None:
    if env.kind == "local":
        url = _write(env, 1)
        assert str(env.staging.materialize(url)) == url  # local roots are engine-visible already
        assert not (env.tmp / "cache").exists()
        return
    a, b = _write(env, 1), _write(env, 2)
    size = sum(p.stat().st_size for p in env.staging.materialize(a).iterdir())
    env.staging.cache_max_bytes = int(size * 1.5)
    local_b = env.staging.materialize(b)
    entries = sorted(p.name for p in (env.tmp / "cache").iterdir())
    assert entries == [local_b.name], "the least recently used snapshot is evicted"
    (local_b / "sentinel").touch()  # a re-download would replace the whole directory
    again = env.staging.materialize(b)  # a hit: same dir, same files, not downloaded again
    assert again == local_b and (again / "sentinel").exists()
    _write(env, 2, seed=5)  # re-exported at the same URL: the cached copy is replaced
    fresh = env.staging.materialize(b)
    assert (fresh / MARKER).read_bytes() == env.read(b, MARKER) and not (fresh / "sentinel").exists()


def test_cli_on_s3_with_aws_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # noqa: F811
    from typer.testing import CliRunner

    from app.cli import app

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    root = f"s3://{s3_server.make_bucket()}/stage"
    base = tiny_hf_base(tmp_path / "base")
    save_file(perturbed_state_dict(base, seed=1), str(tmp_path / "w.safetensors"))
    url = f"{root}/exp9/step_00000003"
    ep = ["--endpoint-url", s3_server.endpoint_url]
    runner = CliRunner()
    r = runner.invoke(app, ["export", "--state-dict", str(tmp_path / "w.safetensors"), "--hf-base", str(base),
                            "--out", url, "--max-shard-size", "200KB", *ep])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["snapshot", "check", url, *ep])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["snapshot", "ls", root, *ep])
    assert r.exit_code == 0 and r.stdout.splitlines()[1].split()[:4] == ["exp9", "3", "True", "False"]
    fs, p = resolve(url, s3_server.storage_options)
    fs.rm_file(f"{p}/{MARKER}")
    r = runner.invoke(app, ["snapshot", "check", url, *ep])
    assert r.exit_code == 1 and "missing_marker" in r.stderr


def test_the_s3_snapshot_cache_is_created_private_and_refused_below_a_directory_others_may_write(
    s3_server: S3Server, tmp_path: Path  # noqa: F811
) -> None:
    """The cache directories `materialize` creates are 0700 whatever the umask; a cache below a
    directory others may write (not sticky) is refused before anything is downloaded."""
    import os
    import stat

    from pinned_eval.trusted_paths import UntrustedPathError

    bucket, opts = s3_server.make_bucket(), s3_server.storage_options
    cache = tmp_path / "home" / "snapshot-cache"
    staging = Staging(f"s3://{bucket}/stage", storage_options=opts, keep_snapshots=2, cache_dir=cache)
    url = staging.path_for("exp1", 4)
    write_snapshot(named_tensors(seed=4), url, storage_options=opts)
    old = os.umask(0)  # a permissive umask: a plain mkdir would make these 0777
    try:
        local = staging.materialize(url)
    finally:
        os.umask(old)
    assert local.parent == cache and check_snapshot(str(local)).complete
    assert [stat.S_IMODE(os.stat(d).st_mode) for d in (tmp_path / "home", cache)] == [0o700, 0o700]

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # a neighbour could replace the cache's weights
    exposed = Staging(f"s3://{bucket}/stage", storage_options=opts, keep_snapshots=2, cache_dir=shared / "cache")
    with pytest.raises(UntrustedPathError, match=r"^snapshot cache .* refused"):
        exposed.materialize(url)
    assert list(shared.iterdir()) == []
