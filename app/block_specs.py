"""What `pinned-eval block save KIND` and `pinned-eval block apply FILE` accept, in the user's words.

One spec per block kind (suite, fleet, staging, sinks). A spec's field names are the CLI's flag
names (`max_new_tokens` is `--max-new-tokens`) and the config file's keys, so a refusal names
what the user typed: `--keep` on the command line, `staging.keep` in `pinned-eval.yaml`
(`SpecError.where`). `build(base_dir)` validates everything a block's own model would refuse and
returns the block; relative paths resolve against `base_dir` (the working directory for flags,
the config file's directory for `apply`) and are stored absolute, because the worker that reads
them runs elsewhere. Secrets never come from argv: engine keys are read from files
(`--api-key-file`, 0600 like the API credential), S3 keys from the standard AWS variables
(`--s3-keys-from-env`), MLflow credentials from MLflow's (`--mlflow-credentials-from-env`).

Prefect is imported inside `build` only (`pinned-eval --help` stays fast).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from pinned_eval.points import BLOCK_NAME_RE

if TYPE_CHECKING:
    from prefect.blocks.core import Block

KINDS = ("suite", "fleet", "staging", "sinks")
BLOCK_NAME = BLOCK_NAME_RE  # Prefect's block names, and a fleet's lock name (pinned_eval.points)
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


class SpecError(ValueError):
    """A refusal naming the field as the user wrote it: `key` is a spec field (or field[index])."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message

    def where(self, prefix: str | None) -> str:
        """`--max-new-tokens: ...` for flags (prefix None), `suite.max_new_tokens: ...` for a file."""
        if prefix is None:  # a flag: its index among repeated flags is in the message already
            return f"--{self.key.split('[')[0].replace('_', '-')}: {self.message}"
        return f"{prefix}.{self.key}: {self.message}"


def spec_errors(exc: ValidationError) -> SpecError:
    """The first pydantic error as a SpecError on its (top-level) field."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    key = loc[0] + "".join(f"[{p}]" for p in loc[1:]) if loc else "value"
    if err["type"] == "extra_forbidden":
        return SpecError(key, "not a known key")
    got = f" (got {err['input']!r:.60})" if "input" in err and not isinstance(err["input"], dict) else ""
    return SpecError(key, f"{err['msg'].removeprefix('Value error, ')}{got}")


def validate_name(name: str) -> str:
    if not BLOCK_NAME.fullmatch(name):
        raise SpecError("name", f"{name!r} is not a block name: lowercase letters, digits and dashes, "
                                "starting with a letter or digit (e.g. default, exp42)")
    return name


def _abs(base: Path, raw: str | Path) -> str:
    return str((base / Path(raw).expanduser()).resolve()) if not str(raw).startswith(("s3://", "s3a://")) else str(raw)


def parse_size(key: str, text: str) -> int:
    """'10GB' -> 10**10 (decimal, as Hugging Face), '512MiB' -> 512 * 2**20, '1000' -> 1000 bytes."""
    m = SIZE.match(text)
    if not m:
        raise SpecError(key, f"{text!r} is not a size like 10GB, 512MiB or 1000000")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def _sample_count(value: Any) -> Any:
    """A samples-per-dataset count as typed: an int (a YAML number) or decimal digits (a flag),
    never a bool, float or other text; its range is the field's (0 to 1000)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,12}", value):
        return int(value)
    raise ValueError("not a whole number from 0 to 1000")


SampleCount = Annotated[int, BeforeValidator(_sample_count), Field(ge=0, le=1000)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SuiteSpec(_Spec):
    """A suite from a miles-style eval YAML (`from_yaml`) or from `dataset` NAME=PATH pairs + sampling."""

    from_yaml: Path | None = None
    set: dict[str, str] = Field(default_factory=dict)
    strict_miles: bool = False
    rm_type: str | None = None
    dataset: list[str] = Field(default_factory=list)
    reward: str | None = None
    max_new_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    samples_per_prompt: int | None = Field(default=None, ge=1)
    max_prompts: int | None = Field(default=None, ge=1)
    input_key: str | None = Field(default=None, min_length=1)
    label_key: str | None = Field(default=None, min_length=1)
    stop: list[str] = Field(default_factory=list)
    chat_template: bool | None = None
    system_prompt: str | None = None
    pass_at_k: bool = False
    point_timeout: float | None = Field(default=None, gt=0, le=7 * 24 * 3600.0)

    def _sampling(self) -> dict[str, Any]:
        pairs = {"reward": self.reward, "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                 "n_samples_per_prompt": self.samples_per_prompt, "max_prompts": self.max_prompts,
                 "input_key": self.input_key, "label_key": self.label_key, "stop": tuple(self.stop) or None,
                 "apply_chat_template": self.chat_template, "system_prompt": self.system_prompt}
        return {k: v for k, v in pairs.items() if v is not None}

    def build(self, base: Path) -> Block:
        from blocks import EvalSuiteBlock  # prefect: slow import
        from pinned_eval.suite import DatasetSpec, EvalSuite, SamplingDefaults

        flags = {"reward": "reward", "max_new_tokens": "max_new_tokens", "temperature": "temperature",
                 "n_samples_per_prompt": "samples_per_prompt", "max_prompts": "max_prompts", "input_key": "input_key",
                 "label_key": "label_key", "stop": "stop", "apply_chat_template": "chat_template",
                 "system_prompt": "system_prompt"}
        sampling = self._sampling()
        if (self.from_yaml is None) == (not self.dataset):
            raise SpecError("dataset", "give the datasets either as --dataset NAME=PATH (repeatable) or in a "
                                       "miles-style eval YAML (--from-yaml FILE), not both")
        if self.from_yaml is not None:
            if sampling:
                raise SpecError(flags[next(iter(sampling))], "set it in the eval YAML (eval.defaults or a dataset), "
                                                             "not next to --from-yaml")
            path = Path(_abs(base, self.from_yaml))
            if not path.is_file():
                raise SpecError("from_yaml", f"{path}: no such file")
            try:
                suite = EvalSuite.from_miles_yaml(path, variables=self.set, strict_miles=self.strict_miles,
                                                  rm_type=self.rm_type, pass_at_k=self.pass_at_k)
            except ValueError as exc:  # a YAML error names the file already; a key error gets it here
                raise SpecError("from_yaml", str(exc) if str(path) in str(exc) else f"{path}: {exc}") from exc
        else:
            for key in ("set", "strict_miles", "rm_type"):
                if getattr(self, key):
                    raise SpecError(key, "applies to --from-yaml only (use --reward with --dataset)")
            datasets = []
            for i, pair in enumerate(self.dataset):
                name, sep, raw = pair.partition("=")
                if not sep or not raw:
                    raise SpecError(f"dataset[{i}]", f"{pair!r}: expected NAME=PATH, e.g. mytask=data/mytask.jsonl")
                try:
                    datasets.append(DatasetSpec(name=name, path=raw if raw.startswith("builtin:") else _abs(base, raw)))
                except ValidationError as exc:
                    raise SpecError(f"dataset[{i}]", f"{pair!r}: dataset name {name!r}: letters, digits, '_', '.' "
                                                     "and '-', starting with a letter or digit") from exc
            try:
                defaults = SamplingDefaults(**sampling)
            except ValidationError as exc:
                err = spec_errors(exc)
                raise SpecError(flags.get(err.key, err.key), err.message) from exc
            try:
                suite = EvalSuite(datasets=tuple(datasets), defaults=defaults, pass_at_k=self.pass_at_k)
            except ValidationError as exc:
                raise SpecError("dataset", spec_errors(exc).message) from exc
        for ds in suite.resolved():
            if ds.path is not None and not ds.path.is_file():  # None: lm-eval tasks (checked at load)
                raise SpecError("dataset" if self.dataset else "from_yaml",
                                f"dataset {ds.name!r}: {ds.path}: no such file")
        if self.point_timeout:
            return EvalSuiteBlock(suite=suite, point_timeout_seconds=self.point_timeout)
        return EvalSuiteBlock(suite=suite)


def _key_file(key: str, path: Path | None) -> Any:
    if path is None:
        return None
    from pydantic import SecretStr

    from pinned_eval.settings import read_auth_file

    try:
        return SecretStr(read_auth_file(path).get_secret_value())
    except (OSError, ValueError) as exc:
        raise SpecError(key, str(exc)) from exc


class FleetSpec(_Spec):
    """Engines to attach to by URL (`attach` + `router`), or a fleet `pinned-eval fleet up` launched."""

    attach: list[str] = Field(default_factory=list)
    router: str | None = None
    api_key_file: Path | None = None
    admin_api_key_file: Path | None = None
    launch: bool = False
    state_file: Path | None = None
    model_path: Path | None = None
    engines: int = Field(default=2, ge=1, le=256)
    backend: Literal["cpu", "sglang"] = "cpu"
    gpus_per_engine: int = Field(default=1, ge=1, le=64)
    lock: str | None = None
    request_concurrency: int = Field(default=32, ge=1, le=4096)
    load_timeout: float = Field(default=600.0, gt=0)
    lora_mode: Literal["adapter", "merged"] = "adapter"

    def build(self, base: Path, name: str) -> Block:
        from blocks import FleetBlock  # prefect: slow import
        from pinned_eval.fleet.launcher import default_state_file

        if bool(self.attach) == self.launch:
            raise SpecError("attach", "give --attach ENGINE_URL (repeatable, with --router URL) for running "
                                      "engines, or --launch for a fleet `pinned-eval fleet up` starts")
        lock = self.lock or name
        if not BLOCK_NAME.fullmatch(lock):
            raise SpecError("lock", f"{lock!r}: lowercase letters, digits and dashes (it names the pin lock "
                                    "fleet-<lock>)")
        common: dict[str, Any] = {
            "name": lock, "request_concurrency": self.request_concurrency, "load_timeout_s": self.load_timeout,
            "lora_mode": self.lora_mode, "api_key": _key_file("api_key_file", self.api_key_file),
            "admin_api_key": _key_file("admin_api_key_file", self.admin_api_key_file),
        }
        if self.attach:
            for key in ("state_file", "model_path"):
                if getattr(self, key) is not None:
                    raise SpecError(key, "applies to --launch only")
            if not self.router:
                raise SpecError("router", "--attach needs the sglang-router URL in front of the engines")
            for i, url in enumerate([*self.attach, self.router]):
                if not url.startswith(("http://", "https://")):
                    raise SpecError("router" if i == len(self.attach) else f"attach[{i}]", f"{url!r} is not an "
                                    "http(s):// URL")
            return FleetBlock(mode="attach", engine_urls=list(self.attach), router_url=self.router, **common)
        if self.router:
            raise SpecError("router", "applies to --attach only (a launched fleet's router is in its state file)")
        state = _abs(base, self.state_file) if self.state_file else str(default_state_file().resolve())
        model = _abs(base, self.model_path) if self.model_path else None
        return FleetBlock(mode="launch", state_file=state, model_path=model, engines=self.engines,
                          backend=self.backend, gpus_per_engine=self.gpus_per_engine, **common)


class StagingSpec(_Spec):
    """Where points stage snapshots (`root`) and where their sources may lie (`source_root`)."""

    root: str | None = Field(default=None, min_length=1)
    s3_bucket_block: str | None = Field(default=None, min_length=1)  # a prefect-aws S3Bucket instead of root
    source_root: list[str] = Field(default_factory=list)
    keep: int = Field(default=2, ge=0, le=1000)
    endpoint_url: str | None = None
    region: str | None = None
    s3_keys_from_env: bool = False
    cache_dir: Path | None = None
    cache_max_size: str | None = None

    def build(self, base: Path) -> Block:
        from pydantic import SecretStr

        from blocks import StagingBlock  # prefect: slow import

        if self.s3_bucket_block is not None:
            _one_bucket("s3_bucket_block", {"root": self.root, "endpoint_url": self.endpoint_url,
                                            "region": self.region, "s3_keys_from_env": self.s3_keys_from_env})
        elif self.root is None:
            raise SpecError("root", "required: a directory or s3://bucket/prefix (or --s3-bucket-block NAME)")
        keys: dict[str, Any] = {}
        if self.s3_keys_from_env:
            missing = [v for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not os.environ.get(v)]
            if missing:
                raise SpecError("s3_keys_from_env", f"{' and '.join(missing)} not set in this environment")
            keys = {"aws_access_key_id": SecretStr(os.environ["AWS_ACCESS_KEY_ID"]),
                    "aws_secret_access_key": SecretStr(os.environ["AWS_SECRET_ACCESS_KEY"])}
        cache_max = parse_size("cache_max_size", self.cache_max_size) if self.cache_max_size else None
        return StagingBlock(
            root=_abs(base, self.root) if self.root else None, s3_bucket_block=self.s3_bucket_block,
            source_roots=[_abs(base, r) for r in self.source_root],
            keep_snapshots=self.keep, endpoint_url=self.endpoint_url, region_name=self.region,
            cache_dir=_abs(base, self.cache_dir) if self.cache_dir else None, cache_max_bytes=cache_max, **keys,
        )


class SinksSpec(_Spec):
    """A JSONL metrics file (`jsonl`), W&B (`wandb_*`), MLflow (`mlflow_*`), TensorBoard (`tensorboard*`);
    `results_root` keeps every point's samples."""

    jsonl: Path | None = None
    results_root: str | None = Field(default=None, min_length=1)
    results_endpoint_url: str | None = None
    results_s3_bucket_block: str | None = Field(default=None, min_length=1)  # prefect-aws S3Bucket: the results root
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_run_id: str | None = None
    wandb_writer: Literal["eval_run", "shared"] = "eval_run"
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    wandb_dir: Path | None = None
    wandb_samples_per_dataset: SampleCount = 0  # the W&B samples table (needs a results root)
    # MLflow and TensorBoard (`_trackers`)
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = Field(default="pinned-eval", min_length=1)
    mlflow_run_id: str | None = None
    mlflow_username: str | None = None
    mlflow_credentials_from_env: bool = False
    mlflow_samples_per_dataset: SampleCount = 0
    tensorboard: bool = False
    tensorboard_dir: Path | None = None

    def build(self, base: Path) -> Block:
        from pydantic import ValidationError

        from blocks import SinksBlock  # prefect: slow import

        if self.wandb_writer == "shared" and self.wandb_mode != "online":
            raise SpecError("wandb_writer", "'shared' writes into the live training run: it needs "
                                            "--wandb-mode online")
        if self.results_s3_bucket_block is not None:
            _one_bucket("results_s3_bucket_block", {"results_root": self.results_root,
                                                    "results_endpoint_url": self.results_endpoint_url})
        if self.wandb_samples_per_dataset and not (self.results_root or self.results_s3_bucket_block):
            raise SpecError("wandb_samples_per_dataset", "needs a results root (results_root or "
                                                         "results_s3_bucket_block): the W&B table is read from "
                                                         "the point's kept samples")
        try:
            return SinksBlock(
                results_s3_bucket_block=self.results_s3_bucket_block,
                jsonl_path=_abs(base, self.jsonl) if self.jsonl else None, wandb_project=self.wandb_project,
                wandb_entity=self.wandb_entity, wandb_run_id=self.wandb_run_id, wandb_writer=self.wandb_writer,
                wandb_mode=self.wandb_mode, wandb_dir=_abs(base, self.wandb_dir) if self.wandb_dir else None,
                wandb_samples_per_dataset=self.wandb_samples_per_dataset,
                results_root=_abs(base, self.results_root) if self.results_root else None,
                results_endpoint_url=self.results_endpoint_url, **self._trackers(base),
            )
        except ValidationError as exc:  # the block's own checks name a block field: the spec's key
            err = spec_errors(exc)
            field, sep, rest = err.message.partition(": ")
            if sep and field in type(self).model_fields:
                raise SpecError(field, rest) from exc
            raise err from exc

    def _trackers(self, base: Path) -> dict[str, Any]:
        """The MLflow and TensorBoard fields of the block; credentials from this shell's environment
        (`MLFLOW_TRACKING_TOKEN`, or `MLFLOW_TRACKING_USERNAME` + `MLFLOW_TRACKING_PASSWORD`), never argv."""
        from pydantic import SecretStr

        fields: dict[str, Any] = {
            "mlflow_tracking_uri": self.mlflow_tracking_uri, "mlflow_experiment": self.mlflow_experiment,
            "mlflow_run_id": self.mlflow_run_id, "mlflow_username": self.mlflow_username,
            "mlflow_samples_per_dataset": self.mlflow_samples_per_dataset, "tensorboard": self.tensorboard,
            "tensorboard_dir": _abs(base, self.tensorboard_dir) if self.tensorboard_dir else None,
        }
        if self.mlflow_credentials_from_env:
            token, password = os.environ.get("MLFLOW_TRACKING_TOKEN"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
            user = self.mlflow_username or os.environ.get("MLFLOW_TRACKING_USERNAME")
            if not token and not (user and password):
                raise SpecError("mlflow_credentials_from_env", "neither MLFLOW_TRACKING_TOKEN nor "
                                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD set in this environment")
            if token:
                fields["mlflow_token"] = SecretStr(token)
            if user and password:
                fields.update(mlflow_username=user, mlflow_password=SecretStr(password))
        return fields


def _one_bucket(key: str, others: dict[str, Any]) -> None:
    """A prefect-aws S3Bucket named by `key` replaces the `others` keys: none may be set; the
    `aws` extra must be installed."""
    from blocks._aws import require_prefect_aws

    for other, value in others.items():
        if value:
            raise SpecError(other, f"set either {other} or {key} (a prefect-aws S3Bucket block), not both")
    try:
        require_prefect_aws(key)
    except ValueError as exc:
        raise SpecError(key, str(exc).removeprefix(f"{key}: ")) from None


SPECS: dict[str, type[_Spec]] = {"suite": SuiteSpec, "fleet": FleetSpec, "staging": StagingSpec, "sinks": SinksSpec}


def build_block(kind: str, fields: dict[str, Any], base: Path, name: str) -> Block:
    """Validate `fields` as the spec of `kind` and build its block (SpecError on any refusal)."""
    validate_name(name)
    try:
        spec = SPECS[kind].model_validate(fields)
    except ValidationError as exc:
        raise spec_errors(exc) from exc
    if isinstance(spec, FleetSpec):
        return spec.build(base, name)
    assert isinstance(spec, SuiteSpec | StagingSpec | SinksSpec)
    return spec.build(base)
