"""Standard-benchmark harnesses run on a point's pinned fleet (docs/harnesses.md).

- `extra`: whether the optional extra `pinned-eval[harness]` is installed (checked when a suite
  that needs it loads);
- `lm_eval_run`: the `lm_eval` rollout kind: a dataset of lm-eval tasks, run by lm-eval's own
  `simple_evaluate` in a subprocess (`lm_eval_child`) against the point's gateway.
This package imports no Prefect; lm-eval is imported only by the subprocess.
"""
