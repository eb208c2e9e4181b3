"""Fleet posture from a plain PyTorch training loop: export in-loop every K steps, dispatch, drain.

The loop trains the tiny model on arithmetic strings ("3+4=7\\n") with SGD. Every `--every` steps
(and at the last step, the final point, which is never skipped) it calls `EvalClient.dispatch`
with an in-loop export: `write_snapshot` writes the step's weights into staging (`.complete`
last), and the call returns in milliseconds plus the export; it never raises into training. The
eval-point flow runs on the worker: check the snapshot, pin the fleet to `str(step)` on every
engine, generate, score, log. `drain` waits for every point; each prints as
`point step=N state=measured weight_version=N mixed=0 arith_add=... arith_sub=...`.

    python examples/fleet_posture_pytorch_loop.py --model-path M     # a running stack (see _stack.py)
    python examples/fleet_posture_pytorch_loop.py --self-contained   # starts and stops its own
"""

from __future__ import annotations

import random

import _stack


def main() -> None:
    p = _stack.parser(__doc__)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--every", type=int, default=2, help="An eval point every K steps.")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pinned_eval.snapshot.writer import write_snapshot
    from trainer_integration import EvalClient

    with _stack.stack(args, "pytorch") as st:
        tokenizer = AutoTokenizer.from_pretrained(st.model_path)
        model = AutoModelForCausalLM.from_pretrained(st.model_path, dtype=torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def export(step: int, dest: str) -> None:  # runs inside dispatch, between two optimizer steps
            write_snapshot(model.state_dict().items(), dest, base_hf_dir=str(st.model_path))

        client = EvalClient(
            st.run, st.api_url, blocks=st.blocks, policy="backpressure", max_in_flight=2,
            staging_root=st.work / "staging", spool_dir=st.work / "spool",  # staging_root = the block's root
        )
        with client:
            rng = random.Random(0)
            for step in range(1, args.steps + 1):
                pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(16)]
                batch = tokenizer([f"{a}+{b}={a + b}\n" for a, b in pairs], return_tensors="pt", padding=True)
                labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
                loss = model(**batch, labels=labels).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                client.report_progress(step)  # feeds eval/lag_steps
                final = step == args.steps
                if step % args.every == 0 or final:
                    res = client.dispatch(step, final=final, export=export)
                    print(f"step {step} loss {loss.item():.3f}: point {res.action}, loop stalled "
                          f"{res.stall_seconds * 1000:.0f} ms (export {(res.export_time_seconds or 0) * 1000:.0f} ms)",
                          flush=True)
            outcomes = client.drain(timeout=600)
        for outcome in outcomes:
            print(_stack.describe(outcome))
        print(f"run {st.run}: metrics in {st.work / 'metrics.jsonl'}; flow runs {st.run}/step-N in the Prefect UI")


if __name__ == "__main__":
    main()
