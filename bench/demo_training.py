"""Demo trainer on CPU: steps/s per phase and the greedy eval accuracy curve.

One run of `DemoTrainer` with its default config (300 supervised warm-up steps on the held-out
facts, then reward-filtered RL on the fully-async producer's rollouts); every `every` steps the
in-process greedy exact-match accuracy on arith_add / arith_sub (the engine decodes the exported
snapshot identically). Evaluation time is excluded from the steps/s figures.

`python -m bench demo_training [--steps N] [--every N]`
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from app.demo.trainer import DemoConfig, DemoTrainer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench demo_training", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1100, help="training steps (default 1100)")
    ap.add_argument("--every", type=int, default=100, help="evaluate every N steps (default 100)")
    args = ap.parse_args(argv or [])
    steps, every = args.steps, args.every
    with tempfile.TemporaryDirectory() as tmp, DemoTrainer(DemoConfig(work_dir=Path(tmp))) as tr:
        acc = tr.evaluate()
        rows = [("0", "-", 0.0, "-", acc["arith_add"], acc["arith_sub"], "-")]
        train_s = {"warmup": 0.0, "rl": 0.0}
        count = {"warmup": 0, "rl": 0}
        window_s, rewards = 0.0, []
        for _ in range(steps):
            t0 = time.perf_counter()
            s = tr.train_step()
            dt = time.perf_counter() - t0
            train_s[s.phase] += dt
            count[s.phase] += 1
            window_s += dt
            if s.reward_mean is not None:
                rewards.append(s.reward_mean)
            if s.step % every == 0:
                acc = tr.evaluate()
                reward = f"{sum(rewards) / len(rewards):.2f}" if rewards else "-"
                rows.append((str(s.step), s.phase, sum(train_s.values()), f"{every / window_s:.1f}",
                             acc["arith_add"], acc["arith_sub"], reward))
                window_s, rewards = 0.0, []
    print(f"{'step':>5} {'phase':>6} {'train_s':>8} {'steps/s':>8} {'add':>5} {'sub':>5} {'reward':>6}")
    for step, phase, t, sps, add, sub, reward in rows:
        print(f"{step:>5} {phase:>6} {t:8.1f} {sps:>8} {add:5.2f} {sub:5.2f} {reward:>6}")
    w, r = train_s["warmup"] / max(count["warmup"], 1), train_s["rl"] / max(count["rl"], 1)
    print(f"warm-up step {w * 1e3:.1f} ms, RL step {r * 1e3:.1f} ms (RL/warm-up {r / w:.1f}x); "
          f"total train time {sum(train_s.values()):.1f} s for {steps} steps")


if __name__ == "__main__":
    main(sys.argv[1:])
