"""`python -m pinned_eval.harness.lm_eval_child`: one lm-eval run, as lm-eval's own `simple_evaluate`.

The worker starts it per point (`pinned_eval.harness.lm_eval_run`); it never runs in the worker.
Contract:
- stdin: one JSON object `{model, model_args, tasks, include_path, limit, num_fewshot, out}`;
  `model_args` go to lm-eval unchanged (the gateway's `/v1/...` URL as `base_url`); the bearer
  token is the environment's `OPENAI_API_KEY`, which lm-eval's `local-*` models send.
- the tasks are looked up with lm-eval's `TaskManager`: with `include_path` (a directory of local
  task YAMLs) only there (`include_defaults=False`: lm-eval's own task index is not read), without
  it in lm-eval's own tasks; an unknown task name exits 2 with one line on stderr naming it, before
  any request.
- the result is written to `out` (JSON): `{"results": {task or group: {key: value}}, "groups":
  {group: {key: value}}, "group_subtasks": {group: [child names]}, "tags": {tag: [task names]},
  "samples": {task: [lm-eval's per-sample records]}}`: lm-eval's own `results`, `groups` (the
  groups with an `aggregate_metric_list`, their aggregates as lm-eval computed them),
  `group_subtasks` and `samples`; `tags` are the member tasks of each requested tag (a tag has no
  aggregate). Numbers as lm-eval computed them (non-JSON values through lm-eval's
  `handle_non_serializable`). Exit 0; any failure exits 1 with its last line on stderr.
This module imports no Prefect and nothing of pinned-eval outside the standard library.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main() -> int:
    req = json.loads(sys.stdin.read())
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    include = req.get("include_path")
    manager = TaskManager(include_path=include, include_defaults=include is None)
    unknown = [t for t in req["tasks"] if t not in manager.all_tasks]
    if unknown:
        where = f" (task_dir {include})" if include else " (lm-eval's own tasks)"
        print(f"tasks: unknown lm-eval task(s) {unknown}{where}", file=sys.stderr)
        return 2
    out: Any = simple_evaluate(
        model=req["model"],
        model_args=req["model_args"],
        tasks=req["tasks"],
        num_fewshot=req.get("num_fewshot"),
        limit=req.get("limit"),
        log_samples=True,
        task_manager=manager,
        apply_chat_template=req["model"] == "local-chat-completions",
    )
    tags = {t: sorted(manager.task_index[t].tags) for t in req["tasks"] if t in manager.all_tags}
    keep = {"results": out["results"], "groups": out.get("groups", {}), "group_subtasks": out.get("group_subtasks", {}),
            "tags": tags, "samples": out["samples"]}
    with open(req["out"], "w", encoding="utf-8") as fh:
        json.dump(keep, fh, default=handle_non_serializable)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # one line for the point's skip; lm-eval's log is on stderr above it
        print(f"{type(exc).__name__}: {exc}"[:2000].replace("\n", " "), file=sys.stderr)
        sys.exit(1)
