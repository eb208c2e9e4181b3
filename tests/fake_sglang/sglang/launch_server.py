"""`python -m sglang.launch_server ...` without GPUs (tests only): takes its arguments as SGLang
0.5.23's `prepare_server_args` does -- a `--config` YAML merged in-process before the command-line
flags (`ConfigArgumentMerger`: config args first, so the command line wins) -- and serves the
bundled CPU engine in this same process with the resulting keys. So this process's command line
is exactly what pinned-eval built for real SGLang, and its keys are whatever reached ServerArgs.
"""

from __future__ import annotations

import argparse
import sys

import yaml


def merged_argv(argv: list[str]) -> list[str]:
    if "--config" not in argv:
        return argv
    i = argv.index("--config")
    with open(argv[i + 1]) as f:
        config = yaml.safe_load(f) or {}
    extra = [a for key, value in config.items() for a in (f"--{key}", str(value))]
    return extra + argv[:i] + argv[i + 2 :]


def main() -> None:
    parser = argparse.ArgumentParser(prog="fake sglang serve")
    for flag in ("--model-path", "--host", "--port", "--api-key", "--admin-api-key", "--weight-version"):
        parser.add_argument(flag)
    args, _ignored = parser.parse_known_args(merged_argv(sys.argv[1:]))  # TP, LoRA, ...: no GPUs here
    from engine.cli import serve

    serve(model_path=args.model_path, port=int(args.port), host=args.host,
          weight_version=args.weight_version or "default", api_key=args.api_key, admin_api_key=args.admin_api_key)


if __name__ == "__main__":
    main()
