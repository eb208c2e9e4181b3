"""`pinned-eval init [DIR]`: a commented project config for a new user, and its reader.

`init` writes three files into DIR (default `.`), refusing (exit 1, naming them) when any exists:
- `pinned-eval.yaml`: the four blocks a point uses (suite, fleet, staging, sinks), one section each,
  keys = the flags of `pinned-eval block save KIND` (`block apply pinned-eval.yaml` saves them);
- `eval.yaml`: a miles-style eval config (`eval.defaults`, `eval.datasets`) the suite reads;
- `data/sample.jsonl`: a tiny dataset (`{"prompt": ..., "label": ...}` rows) it names.

`load_project_config(path)` reads such a file: a mapping of sections from `KINDS`, each a mapping
(or absent); a YAML syntax error names the file and line, any other refusal the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from app.block_specs import KINDS
from app.commands._cli import fail

CONFIG_NAME = "pinned-eval.yaml"

PROJECT_CONFIG = """\
# pinned-eval project config, written by `pinned-eval init`.
# `pinned-eval block apply pinned-eval.yaml` saves each section below as a block named `default`
# (the names a point uses unless `request --suite/--fleet/--staging/--sinks` say otherwise).
# Keys are the flags of `pinned-eval block save KIND` (`--max-new-tokens` is `max_new_tokens`);
# relative paths are relative to this file. `pinned-eval block show KIND` shows what was saved.

suite:                       # what every point measures
  from_yaml: eval.yaml       # a miles-style eval config (or: dataset: ["mytask=data/mytask.jsonl"])
  # point_timeout: 10800     # seconds a point may take once admitted

fleet:                       # the engines a point pins to one weight version
  launch: true               # the fleet `pinned-eval fleet up --model-path DIR` starts
  # state_file: .pinned-eval/fleet/fleet.json   # fleet up's state file (this is its default)
  # or running engines instead of `launch`:
  # attach: [http://127.0.0.1:30001, http://127.0.0.1:30002]
  # router: http://127.0.0.1:30000
  # api_key_file: engine-api-key          # files of mode 0600, never keys in this file
  # admin_api_key_file: engine-admin-key

staging:                     # where points stage snapshots, and where your checkpoints may lie
  root: .pinned-eval/staging # a local directory (tmpfs is best) or s3://bucket/prefix
  # s3_bucket_block: my-bucket  # or a saved prefect-aws S3Bucket block instead of root (pinned-eval[aws])
  source_root: [checkpoints, .pinned-eval/tiny]   # a point's --source must lie under one of these
  keep: 2                    # staged snapshots kept per run, for `pinned-eval rerun`

sinks:                       # where metrics go besides the Prefect UI
  jsonl: .pinned-eval/metrics.jsonl
  # results_root: .pinned-eval/results   # keep every point's samples: `pinned-eval compare` / `rescore`
  # results_s3_bucket_block: my-bucket  # or a prefect-aws S3Bucket block as the results root
  # wandb_project: my-project
  # wandb_mode: offline      # offline, online or disabled
  # wandb_samples_per_dataset: 8   # samples per dataset in the W&B table (0 to 1000; needs results_root)
  # mlflow_tracking_uri: http://127.0.0.1:5000   # MLflow (pip install 'pinned-eval[mlflow]')
  # mlflow_run_id: <the training run's MLflow run id>   # unset: a run <run>-eval of its own
  # mlflow_samples_per_dataset: 8  # samples per dataset in the MLflow table artifact (0 to 1000)
  # tensorboard_dir: runs/exp1   # the trainer's TensorBoard logdir (pip install 'pinned-eval[tensorboard]')
"""

EVAL_CONFIG = """\
# A miles-style eval config: the keys of miles' `eval:` section (miles can read this file too).
# `pinned-eval suite miles eval.yaml` prints the datasets it means, every field resolved.
eval:
  defaults:
    rm_type: exact_match     # the reward: exact_match, math, deepscaler, f1, gpqa, ...
    max_response_len: 8      # tokens per response
    temperature: 0.0         # 0 is greedy
  datasets:
    - name: sample           # logged as eval/sample
      path: data/sample.jsonl    # JSONL or Parquet, relative to this file
      input_key: prompt      # row key of the prompt
      label_key: label       # row key of the expected answer
"""

SAMPLE_ROWS = [(a, b) for a in (1, 2, 3, 4) for b in (2, 5)]


def sample_jsonl() -> str:
    import json

    return "".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n" for a, b in SAMPLE_ROWS)


def init(
    directory: Annotated[Path, typer.Argument(help="Project directory (created if missing).")] = Path("."),
) -> None:
    """Write a commented project config (pinned-eval.yaml), a miles-style eval.yaml and a sample dataset."""
    files = {
        directory / CONFIG_NAME: PROJECT_CONFIG,
        directory / "eval.yaml": EVAL_CONFIG,
        directory / "data" / "sample.jsonl": sample_jsonl(),
    }
    existing = [str(p) for p in files if p.exists() or p.is_symlink()]
    if existing:
        fail(f"{', '.join(existing)} exists; nothing written (init never overwrites)")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "x") as f:  # exclusive: never replaces a file created meanwhile
            f.write(text)
    typer.echo("wrote " + ", ".join(str(p) for p in files))
    here = "" if directory.resolve() == Path.cwd().resolve() else f"cd {directory}\n  "
    typer.echo(
        "next:\n"
        f"  {here}pinned-eval tiny-model --out .pinned-eval/tiny   # or mark your own: pinned-eval snapshot mark DIR\n"
        "  pinned-eval server up && pinned-eval deploy\n"
        "  pinned-eval fleet up --model-path .pinned-eval/tiny\n"
        "  pinned-eval block apply pinned-eval.yaml\n"
        "  pinned-eval worker          # in another terminal\n"
        "  pinned-eval request --run exp1 --step 0 --source hf:$PWD/.pinned-eval/tiny --wait"
    )


def load_project_config(path: Path) -> dict[str, dict[str, Any]]:
    """The sections of a project config (see the module docstring); ValueError names file and key."""
    from pinned_eval.yaml_files import load_yaml_file, shown_key

    root = load_yaml_file(path)  # regular files only, bounded size and nesting, duplicate keys refused
    if not isinstance(root, dict):
        raise ValueError(f"{path}: expected sections {', '.join(KINDS)} (a mapping), got {type(root).__name__}")
    unknown = [k for k in root if k not in KINDS]
    if unknown:
        raise ValueError(f"{path}: {shown_key(unknown[0])}: not a section (sections: {', '.join(KINDS)})")
    out: dict[str, dict[str, Any]] = {}
    for kind, fields in root.items():
        if fields is None:
            continue
        if not isinstance(fields, dict):
            raise ValueError(f"{path}: {kind}: must be a mapping of keys (the flags of `block save {kind}`)")
        out[kind] = fields
    if not out:
        raise ValueError(f"{path}: no section to save (sections: {', '.join(KINDS)})")
    return out
