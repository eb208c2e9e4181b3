"""Shared posture: measure the training engines themselves, with the rollout producer gated.

The CPU fleet plays the training engines. A `FullyAsyncProducer` keeps generating rollouts from
them through the router. After each training step the trainer pushes new weights to every engine
(`/update_weights_from_disk`, standing in for a weight sync) and tags them with
`/update_weight_version` = str(step), as miles does. Every `--every` steps
`await client.evaluate_now(step, gate)` closes the `ProducerGate` (new submissions stop, groups in
flight finish into the buffer, nothing is aborted), runs a `posture="shared"` point (it verifies
every engine reports str(step), then generates the eval through the router) and reopens the gate
in `finally`. No snapshot, no load: the version is pinned by call order.

    python examples/shared_posture_gate.py --model-path M     # a running stack (see _stack.py)
    python examples/shared_posture_gate.py --self-contained
"""

from __future__ import annotations

import asyncio

import _stack


async def train(st: _stack.Stack, steps: int, every: int) -> None:
    import httpx

    from app.demo.rollouts import CyclingSource, PromptItem
    from app.demo.tasks import facts, reward
    from engine.tiny_model import perturb_snapshot
    from trainer_integration import EvalClient, FullyAsyncProducer, ProducerConfig, ProducerGate
    from trainer_integration.rollout_buffer import Sample

    engines, router = st.fleet_urls()
    data, admin = st.fleet_headers()  # the engines' keys: the trainer owns this fleet
    http = httpx.AsyncClient(timeout=120, headers=data)

    async def generate_group(group: list[Sample], sample_done: object) -> list[Sample]:  # one /generate per sample
        async def one(s: Sample) -> None:
            params = {"max_new_tokens": 3, "temperature": 1.0, "stop": ["\n"]}
            out = (await http.post(f"{router}/generate", json={"text": s.prompt, "sampling_params": params})).json()
            s.response, s.status, s.reward = out["text"], "completed", reward(out["text"], s.label)
            s.weight_version = int(out["meta_info"]["weight_version"])

        await asyncio.gather(*(one(s) for s in group))
        return group

    async def push_weights(step: int) -> None:  # the trainer's weight sync (here: perturbed weights)
        path = st.model_path if step == 0 else perturb_snapshot(st.model_path, st.work / f"w{step}", seed=step)
        for url in engines:
            load = {"model_path": str(path)}
            (await http.post(f"{url}/update_weights_from_disk", json=load, headers=admin)).raise_for_status()
            tag = {"new_version": str(step), "abort_all_requests": False}
            (await http.post(f"{url}/update_weight_version", json=tag, headers=admin)).raise_for_status()

    gate = ProducerGate()
    config = ProducerConfig(rollout_batch_size=4, n_samples_per_prompt=2, max_weight_staleness=1)
    source = CyclingSource([PromptItem(f.prompt, f.label) for f in facts("all")], n=2, seed=0)
    await push_weights(0)
    with EvalClient(st.run, st.api_url, blocks=st.blocks, spool_dir=st.work / "spool") as client:
        async with FullyAsyncProducer(config, generate_group, source, gate=gate) as producer:
            producer.set_weight_version(0)
            for step in range(1, steps + 1):
                batch = await producer.get_batch()  # ... the optimizer step on `batch` goes here
                rewards = [s.reward for g in batch.groups for s in g]
                await push_weights(step)
                producer.set_weight_version(step)
                client.report_progress(step)
                print(f"step {step}: {len(rewards)} rollouts, reward {sum(rewards) / len(rewards):.2f}", flush=True)
                if step % every == 0 or step == steps:
                    outcome = await client.evaluate_now(step, gate, final=step == steps, timeout=600)
                    print(_stack.describe(outcome), f"gate_open={gate.is_open} gate_closed_times={gate.times_closed}")
    await http.aclose()


def main() -> None:
    p = _stack.parser(__doc__)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--every", type=int, default=1, help="A shared point every K steps.")
    args = p.parse_args()
    with _stack.stack(args, "shared") as st:
        asyncio.run(train(st, args.steps, args.every))


if __name__ == "__main__":
    main()
