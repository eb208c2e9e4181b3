"""`pinned-eval block save|show|list|apply`: the blocks a point uses, saved without Python.

- `block save suite|fleet|staging|sinks NAME [flags]` builds one block from flags
  (`app.block_specs`: flag names are the spec's fields) and saves it; an existing block of that
  name is replaced only with `--overwrite`.
- `block apply FILE [--name NAME]` saves every section (`suite`, `fleet`, `staging`, `sinks`) of a
  project config (`pinned-eval init` writes one) under NAME (default `default`, the names a point
  uses unless told otherwise), replacing blocks of that name. Every section is checked before any
  is saved; relative paths resolve against the file's directory.
- `block show KIND NAME` prints the saved fields as JSON, secrets masked (`********`);
  `block list` prints `kind name` of every saved pinned-eval block.
- `missing_blocks()` (printed by `deploy`) names the `default` blocks that do not exist and the
  command that creates each.

Exit codes: 0 done; 1 Prefect unreachable, the block does not exist (show), it exists (save
without `--overwrite`); 2 bad input (the message names the flag, or `FILE: section.key`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from app.block_specs import KINDS, SpecError, build_block
from app.commands.points import BLOCK_FLAGS, block_exists, fail, prefect_client
from app.commands.suite import _variables
from pinned_eval.events import BlockNames

if TYPE_CHECKING:
    from prefect.blocks.core import Block

app = typer.Typer(help="Save, show and list the blocks a point uses (suite, fleet, staging, sinks).",
                  no_args_is_help=True)
save_app = typer.Typer(help="Save one block from flags.", no_args_is_help=True)
app.add_typer(save_app, name="save")

SLUGS = {**BLOCK_FLAGS, "backend": "pinned-eval-external-backend"}  # kind -> block type slug (show, list)
DEFAULT_NAME = "default"
# what creates each missing block, in `deploy`'s note and `block show`'s refusal
HOW = {
    "suite": "pinned-eval block save suite {name} --dataset NAME=FILE.jsonl (or --from-yaml eval.yaml)",
    "fleet": "pinned-eval block save fleet {name} --launch (after `pinned-eval fleet up`) or --attach URL --router URL",
    "staging": "pinned-eval block save staging {name} --root DIR --source-root CHECKPOINTS_DIR",
    "sinks": "pinned-eval block save sinks {name} --jsonl FILE",
}

NameArg = Annotated[str, typer.Argument(help="Block name (lowercase letters, digits, dashes); points use 'default'.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace a block of this name.")]


def _build(kind: str, name: str, fields: dict[str, Any]) -> Block:
    try:
        return build_block(kind, fields, Path.cwd(), name)
    except SpecError as exc:
        fail(f"NAME: {exc.message}" if exc.key == "name" else exc.where(None), 2)


def _save(kind: str, name: str, fields: dict[str, Any], overwrite: bool) -> None:
    block = _build(kind, name, fields)
    with prefect_client() as client:
        if not overwrite and block_exists(client, kind, name):
            fail(f"a {kind} block named {name!r} exists: pass --overwrite to replace it "
                 f"(`pinned-eval block show {kind} {name}` shows it)")
        reset = resets(client, kind, name, block)
        block.save(name, overwrite=True)
    typer.echo(f"saved {kind} block {name!r}{reset}")


@save_app.command("suite")
def save_suite(
    name: NameArg,
    from_yaml: Annotated[Path | None, typer.Option("--from-yaml", help="miles-style eval YAML (eval.defaults, "
                                                   "eval.datasets); relative paths from its directory.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="NAME=VALUE for ${NAME} in the YAML.")] = None,
    strict_miles: Annotated[bool, typer.Option("--strict-miles", help="Refuse pinned-eval's YAML extensions.")] = False,
    rm_type: Annotated[str | None, typer.Option("--rm-type", help="miles' --rm-type for YAML datasets "
                                                "without one.")] = None,
    dataset: Annotated[list[str] | None, typer.Option("--dataset", help="NAME=FILE (JSONL or Parquet), "
                                                      "repeatable; logged as eval/NAME.")] = None,
    reward: Annotated[str | None, typer.Option("--reward", help="exact_match (default), math, f1, ..., "
                                               "custom:module:function.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", help="Tokens per response "
                                                       "(default 1024).")] = None,
    temperature: Annotated[float | None, typer.Option("--temperature", help="0 is greedy (default 1.0).")] = None,
    samples_per_prompt: Annotated[int | None, typer.Option("--samples-per-prompt", help="Responses per "
                                                           "prompt (default 1).")] = None,
    max_prompts: Annotated[int | None, typer.Option("--max-prompts", help="Use at most N prompts.")] = None,
    input_key: Annotated[str | None, typer.Option("--input-key", help="Row key of the prompt (prompt).")] = None,
    label_key: Annotated[str | None, typer.Option("--label-key", help="Row key of the label (label).")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string, repeatable.")] = None,
    chat_template: Annotated[bool | None, typer.Option("--chat-template/--no-chat-template",
                                                       help="Render prompts with the model's chat template.")] = None,
    system_prompt: Annotated[str | None, typer.Option("--system-prompt", help="System message (chat).")] = None,
    pass_at_k: Annotated[bool, typer.Option("--pass-at-k", help="Log eval/NAME-pass@k where n > 1.")] = False,
    point_timeout: Annotated[float | None, typer.Option("--point-timeout", help="Seconds a point may take "
                                                        "(default 3 h).")] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Save an eval suite: datasets from --dataset NAME=FILE and sampling flags, or a miles-style YAML."""
    try:
        variables = _variables(set_ or [])
    except typer.BadParameter as exc:
        fail(f"--set: {exc.message}", 2)
    _save("suite", name, {
        "from_yaml": from_yaml, "set": variables, "strict_miles": strict_miles, "rm_type": rm_type,
        "dataset": dataset or [], "reward": reward, "max_new_tokens": max_new_tokens, "temperature": temperature,
        "samples_per_prompt": samples_per_prompt, "max_prompts": max_prompts, "input_key": input_key,
        "label_key": label_key, "stop": stop or [], "chat_template": chat_template, "system_prompt": system_prompt,
        "pass_at_k": pass_at_k, "point_timeout": point_timeout,
    }, overwrite)


@save_app.command("fleet")
def save_fleet(
    name: NameArg,
    attach: Annotated[list[str] | None, typer.Option("--attach", help="URL of a running engine, repeatable "
                                                     "(with --router).")] = None,
    router: Annotated[str | None, typer.Option("--router", help="sglang-router URL in front of --attach "
                                               "engines.")] = None,
    api_key_file: Annotated[Path | None, typer.Option("--api-key-file", help="File (mode 0600) holding the "
                                                      "engines' API key.")] = None,
    admin_api_key_file: Annotated[Path | None, typer.Option("--admin-api-key-file", help="File (mode 0600) "
                                                            "holding the engines' admin key.")] = None,
    launch: Annotated[bool, typer.Option("--launch", help="The fleet `pinned-eval fleet up` starts "
                                         "(keys and URLs from its state file).")] = False,
    state_file: Annotated[Path | None, typer.Option("--state-file", help="`fleet up`'s state file "
                                                    "(default: the home's fleet/fleet.json).")] = None,
    model_path: Annotated[Path | None, typer.Option("--model-path", help="Checkpoint a relaunch boots from.")] = None,
    engines: Annotated[int, typer.Option("--engines", help="Engines a relaunch starts.")] = 2,
    backend: Annotated[str, typer.Option("--backend", help="cpu or sglang (relaunch).")] = "cpu",
    gpus_per_engine: Annotated[int, typer.Option("--gpus-per-engine", help="SGLang TP size (relaunch).")] = 1,
    lock: Annotated[str | None, typer.Option("--lock", help="Pin lock name fleet-LOCK (default: NAME); blocks "
                                             "of the same engines share it.")] = None,
    request_concurrency: Annotated[int, typer.Option("--request-concurrency", help="Generate requests in "
                                                     "flight.")] = 32,
    load_timeout: Annotated[float, typer.Option("--load-timeout", help="Seconds one weight load may take.")] = 600.0,
    lora_mode: Annotated[str, typer.Option("--lora-mode", help="adapter or merged (LoRA sources).")] = "adapter",
    overwrite: OverwriteOpt = False,
) -> None:
    """Save a fleet: running engines (--attach URL ... --router URL) or a `fleet up` fleet (--launch)."""
    _save("fleet", name, {
        "attach": attach or [], "router": router, "api_key_file": api_key_file,
        "admin_api_key_file": admin_api_key_file, "launch": launch, "state_file": state_file,
        "model_path": model_path, "engines": engines, "backend": backend, "gpus_per_engine": gpus_per_engine,
        "lock": lock, "request_concurrency": request_concurrency, "load_timeout": load_timeout,
        "lora_mode": lora_mode,
    }, overwrite)


@save_app.command("staging")
def save_staging(
    name: NameArg,
    root: Annotated[str | None, typer.Option("--root", help="Directory (tmpfs recommended) or s3://bucket/prefix "
                                             "where points stage snapshots.")] = None,
    s3_bucket_block: Annotated[str | None, typer.Option("--s3-bucket-block", help="A saved prefect-aws S3Bucket "
                                                        "block (bucket, folder, AwsCredentials) instead of "
                                                        "--root and the S3 flags.")] = None,
    source_root: Annotated[list[str] | None, typer.Option("--source-root", help="Directory or s3:// prefix "
                                                          "your checkpoints lie under, repeatable.")] = None,
    keep: Annotated[int, typer.Option("--keep", help="Staged snapshots kept per run for reruns.")] = 2,
    endpoint_url: Annotated[str | None, typer.Option("--endpoint-url", help="S3 endpoint (MinIO, ...).")] = None,
    region: Annotated[str | None, typer.Option("--region", help="S3 region.")] = None,
    s3_keys_from_env: Annotated[bool, typer.Option("--s3-keys-from-env", help="Store AWS_ACCESS_KEY_ID and "
                                                   "AWS_SECRET_ACCESS_KEY of this shell (as secrets).")] = False,
    cache_dir: Annotated[Path | None, typer.Option("--cache-dir", help="Local cache S3 snapshots load from.")] = None,
    cache_max_size: Annotated[str | None, typer.Option("--cache-max-size", help="Cache bound, e.g. 50GB.")] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Save staging: where points stage snapshots, and where their sources may lie."""
    _save("staging", name, {
        "root": root, "s3_bucket_block": s3_bucket_block, "source_root": source_root or [], "keep": keep,
        "endpoint_url": endpoint_url,
        "region": region, "s3_keys_from_env": s3_keys_from_env, "cache_dir": cache_dir,
        "cache_max_size": cache_max_size,
    }, overwrite)


@save_app.command("sinks")
def save_sinks(
    name: NameArg,
    jsonl: Annotated[Path | None, typer.Option("--jsonl", help="Metrics file, one row per run, step, "
                                               "dataset.")] = None,
    wandb_project: Annotated[str | None, typer.Option("--wandb-project", help="W&B project (unset: no "
                                                      "W&B).")] = None,
    wandb_entity: Annotated[str | None, typer.Option("--wandb-entity", help="W&B team or user.")] = None,
    wandb_run_id: Annotated[str | None, typer.Option("--wandb-run-id", help="The training run's W&B id "
                                                     "(default: the run name).")] = None,
    wandb_writer: Annotated[str, typer.Option("--wandb-writer", help="eval_run or shared.")] = "eval_run",
    wandb_mode: Annotated[str, typer.Option("--wandb-mode", help="offline, online or disabled.")] = "offline",
    wandb_dir: Annotated[Path | None, typer.Option("--wandb-dir", help="W&B's local files.")] = None,
    wandb_samples_per_dataset: Annotated[str, typer.Option("--wandb-samples-per-dataset", metavar="N",
                                                           help="Samples per dataset in the point's W&B table "
                                                           "(0 to 1000; needs a results root).")] = "0",
    results_root: Annotated[str | None, typer.Option("--results-root", help="Keep every point's samples "
                                                     "(Parquet) under this directory or s3://bucket/prefix: "
                                                     "`compare` and `rescore` read them.")] = None,
    results_endpoint_url: Annotated[str | None, typer.Option("--results-endpoint-url", help="S3 endpoint of an "
                                                             "s3:// --results-root.")] = None,
    results_s3_bucket_block: Annotated[str | None, typer.Option("--results-s3-bucket-block", help="A saved "
                                                                "prefect-aws S3Bucket block as the results root "
                                                                "instead of --results-root.")] = None,
    mlflow_tracking_uri: Annotated[str | None, typer.Option("--mlflow-tracking-uri", help="MLflow tracking "
                                                            "server http(s)://HOST:PORT (unset: no MLflow).")] = None,
    mlflow_experiment: Annotated[str, typer.Option("--mlflow-experiment", help="Experiment of the eval run "
                                                   "(without --mlflow-run-id).")] = "pinned-eval",
    mlflow_run_id: Annotated[str | None, typer.Option("--mlflow-run-id", help="The training run's MLflow run "
                                                      "id (default: a run <run>-eval of its own).")] = None,
    mlflow_username: Annotated[str | None, typer.Option("--mlflow-username", help="MLflow basic-auth user.")] = None,
    mlflow_credentials_from_env: Annotated[bool, typer.Option("--mlflow-credentials-from-env", help="Store "
                                           "MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD of this "
                                           "shell (as secrets).")] = False,
    mlflow_samples_per_dataset: Annotated[str, typer.Option("--mlflow-samples-per-dataset", metavar="N",
                                                            help="Samples per dataset in the point's MLflow "
                                                            "table (0 to 1000).")] = "0",
    tensorboard: Annotated[bool, typer.Option("--tensorboard", help="TensorBoard scalars in "
                                              "<results-root>/<run>/tensorboard.")] = False,
    tensorboard_dir: Annotated[Path | None, typer.Option("--tensorboard-dir", help="The trainer's TensorBoard "
                                                         "log directory (points write its eval/).")] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Save sinks: a JSONL metrics file, W&B, MLflow and/or TensorBoard (Prefect artifacts are always written)."""
    _save("sinks", name, {
        "jsonl": jsonl, "wandb_project": wandb_project, "wandb_entity": wandb_entity,
        "wandb_run_id": wandb_run_id, "wandb_writer": wandb_writer, "wandb_mode": wandb_mode,
        "wandb_dir": wandb_dir, "wandb_samples_per_dataset": wandb_samples_per_dataset,
        "results_root": results_root, "results_endpoint_url": results_endpoint_url,
        "results_s3_bucket_block": results_s3_bucket_block,
        "mlflow_tracking_uri": mlflow_tracking_uri, "mlflow_experiment": mlflow_experiment,
        "mlflow_run_id": mlflow_run_id, "mlflow_username": mlflow_username,
        "mlflow_credentials_from_env": mlflow_credentials_from_env,
        "mlflow_samples_per_dataset": mlflow_samples_per_dataset, "tensorboard": tensorboard,
        "tensorboard_dir": tensorboard_dir,
    }, overwrite)


@app.command("show")
def show(
    kind: Annotated[str, typer.Argument(help="suite, fleet, staging, sinks or backend.")],
    name: Annotated[str, typer.Argument(help="Block name.")] = DEFAULT_NAME,
) -> None:
    """Print a saved block's fields as JSON (secrets masked)."""
    from prefect.exceptions import ObjectNotFound  # prefect: slow import; `pinned-eval --help` stays fast

    if kind not in SLUGS:
        fail(f"KIND: {kind!r} is not one of {', '.join(SLUGS)}", 2)
    with prefect_client() as client:
        try:
            doc = client.read_block_document_by_name(name, SLUGS[kind], include_secrets=False)
        except ObjectNotFound:
            how = f": create it with `{HOW[kind].format(name=name)}`" if kind in HOW else ""
            fail(f"no {kind} block named {name!r}{how}")
    typer.echo(json.dumps(doc.data, indent=2, sort_keys=True, default=str))


@app.command("list")
def list_blocks() -> None:
    """Print `kind name` of every saved pinned-eval block."""
    kinds = {slug: kind for kind, slug in SLUGS.items()}
    with prefect_client() as client:
        docs = client.read_block_documents(include_secrets=False)  # one call: unregistered kinds are no error
    rows = sorted((list(SLUGS).index(kinds[d.block_type.slug]), d.name) for d in docs
                  if d.block_type is not None and d.block_type.slug in kinds and d.name and not d.is_anonymous)
    for index, name in rows:
        typer.echo(f"{list(SLUGS)[index]:<8} {name}")


@app.command("apply")
def apply(
    path: Annotated[Path, typer.Argument(help="Project config (pinned-eval.yaml, see `pinned-eval init`).")],
    name: Annotated[str, typer.Option("--name", help="Save every block under this name.")] = DEFAULT_NAME,
) -> None:
    """Save every block a project config describes (replacing blocks of that name)."""
    from app.commands.init import load_project_config

    try:
        sections = load_project_config(path)  # the one reading step
    except ValueError as exc:
        fail(str(exc), 2)
    except RecursionError:
        fail(f"{path}: nested too deeply to read", 2)
    built: dict[str, Block] = {}
    for kind, fields in sections.items():
        try:
            built[kind] = build_block(kind, fields, path.resolve().parent, name)
        except SpecError as exc:
            fail(f"--name: {exc.message}" if exc.key == "name" else f"{path}: {exc.where(kind)}", 2)
    with prefect_client() as client:
        for kind, block in built.items():
            replaced = block_exists(client, kind, name)
            reset = resets(client, kind, name, block) if replaced else ""
            block.save(name, overwrite=True)
            typer.echo(f"{'replaced' if replaced else 'saved'} {kind} block {name!r}{reset}")


def resets(client: Any, kind: str, name: str, block: Block) -> str:
    """`; reset: FIELD (was VALUE), ...` for each field of the saved block `name` that `block` sets back
    to its default (a key the file or flags no longer give); "" when none or no block is saved.
    Secret fields are compared by presence only and their values never shown."""
    from prefect.exceptions import ObjectNotFound  # prefect: slow import; `pinned-eval --help` stays fast
    from pydantic import SecretStr

    try:
        old = client.read_block_document_by_name(name, SLUGS[kind], include_secrets=False).data
    except ObjectNotFound:
        return ""
    lost = []
    for field, info in type(block).model_fields.items():
        was, now = old.get(field), getattr(block, field, None)
        if was in (None, [], {}, "") or field not in old:
            continue
        if isinstance(now, SecretStr) or was == "********":
            if now is None:
                lost.append(f"{field} (was set)")
            continue
        default = info.get_default(call_default_factory=True)
        if now == default and was != (default.model_dump(mode="json") if hasattr(default, "model_dump") else default):
            lost.append(f"{field} (was {json.dumps(was, default=str)[:80]})")
    return f"; reset to default: {', '.join(lost)}" if lost else ""


def missing_blocks(names: BlockNames | None = None) -> list[str]:
    """One line per block of `names` (default: every kind's `default`, what a point uses unless
    told otherwise) that does not exist, naming the command that creates it. A point naming a
    missing block is skipped by its flow run; `deploy` prints these lines so it is known before."""
    names = names or BlockNames()
    with prefect_client() as client:
        missing = [kind for kind in KINDS if not block_exists(client, kind, getattr(names, kind))]
    return [f"missing {kind} block {getattr(names, kind)!r}: create it with "
            f"`{HOW[kind].format(name=getattr(names, kind))}`" for kind in missing]


def note_missing_blocks() -> None:
    """Print `missing_blocks()` on stderr, or that every default block exists (what `deploy` ends with)."""
    lines = missing_blocks()
    for line in lines:
        typer.echo(line, err=True)
    if not lines:
        typer.echo(f"blocks {', '.join(KINDS)} {DEFAULT_NAME!r} exist")
