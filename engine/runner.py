"""The model thread: a continuous-batching scheduler over a transformers causal LM on CPU.

Contract and invariants:
- One dedicated thread owns the model. Everything touching it (prefill, decode, weight loads,
  pause/resume, version changes) runs there, between decode steps, so the asyncio event loop is
  never blocked. Callers get `concurrent.futures.Future`s.
- Batching (the documented choice): continuous batching with a shared, left-padded KV cache.
  Each loop iteration admits every pending sequence (up to `max_batch_size` rows), prefills the
  newcomers together, merges their cache into the running batch (left-padding the shorter one),
  then runs ONE decode step for all rows. Finished rows leave the batch at once (cache rows are
  dropped, fully padded leading columns trimmed), so short and long requests share forwards and a
  newcomer never waits for the batch to drain.
- Row invariant: the cache holds every token of a row except its last output token, which is the
  next decode input. Prefill therefore feeds prompt + output so far (a retracted row resumes
  exactly; its generator state is kept).
- Each row samples with its own generator (decoding.py), so a seeded request is reproducible
  whatever shares its batch (up to float noise of different padding).
- `weight_version` / `model_path` change only on the model thread, after a successful load, so
  per-token version spans (`weight_versions`) are exact. A failed load marks the weights unknown
  (`weights_ok` False) and aborts everything in flight; only a later successful load clears it.
- LoRA (engine/lora.py): a sequence may carry an adapter; the rows of every forward are handed to
  `LoraHooks` just before it, so each row gets its own adapter's delta (or none).
- Logprobs (a sequence with `logprobs` set): each output token's logprob and top-k come from
  `decoding.token_logprobs` at the step that chose it; prompt logprobs come from one extra
  forward over the prompt when the sequence is admitted (`KVBatch.full_logits`), also for
  `max_new_tokens == 0` (lm-eval's loglikelihood requests), kept across retractions.
- Scripted sequences (`script`, engine/scripted.py) emit their tokens instead of sampling.
- Pause modes (SGLang): abort = abort everything; retract = rows go back to the waiting queue
  (cache dropped, recomputed on continue); in_place = rows keep their cache and wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import decoding, weights
from engine.batch import KVBatch, Logprobs, SeqResult, Sequence, Top
from engine.lora import LoraHooks

__all__ = ["Runner", "SeqResult", "Sequence", "Stats"]

log = logging.getLogger("pinned_eval.engine")


@dataclass
class Stats:
    requests_finished: int = 0
    requests_aborted: int = 0
    tokens_generated: int = 0
    prefill_batches: int = 0
    decode_steps: int = 0
    max_batch_size_seen: int = 0
    max_prefill_batch_seen: int = 0
    weight_loads: int = 0
    weight_load_failures: int = 0


class Runner:
    """Owns the model, its thread, the waiting queue and the running batch."""

    def __init__(
        self,
        model_path: str,
        weight_version: str,
        threads: int = 1,
        max_batch_size: int = 64,
        context_length: int | None = None,
    ) -> None:
        from transformers import (  # transformers: slow import, only when a model is loaded
            AutoModelForCausalLM,
            AutoTokenizer,
        )

        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        config = self.model.config
        eos = self.model.generation_config.eos_token_id or config.eos_token_id or self.tokenizer.eos_token_id
        self.eos_ids: list[int] = sorted({eos} if isinstance(eos, int) else set(eos or []))
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self.bos_id: int = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.pad_id
        self.vocab_size: int = int(config.vocab_size)
        self.context_len: int = context_length or int(getattr(config, "max_position_embeddings", 2048))
        self.model_type: str = config.model_type
        self.architectures: list[str] = list(getattr(config, "architectures", None) or [])
        self.max_batch_size = max_batch_size
        self.model_path = model_path
        self.load_format = "auto"
        self.weight_version = weight_version
        self.weights_ok = True
        self.stats = Stats()
        self._cond = threading.Condition()
        self._pending: deque[Sequence] = deque()
        self._live: set[Sequence] = set()
        self._jobs: list[Callable[[], None]] = []
        self._dirty = False
        self._stopping = False
        self._paused = False
        self._batch = KVBatch(self.model, self.pad_id)
        self.lora = LoraHooks(self.model)  # adapters; per-row deltas at forward time
        self._thread = threading.Thread(target=self._loop, name="engine-model", daemon=True)

    # ---- API for other threads ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.generator = decoding.make_generator(seq.seed)
        with self._cond:
            self._pending.extend(seqs)
            self._live.update(seqs)
            self._cond.notify_all()

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "Aborted by request.") -> int:
        """Flag matching live sequences (rid equal or `rid_<i>` copies); returns how many."""
        with self._cond:
            hits = [s for s in self._live if abort_all or (rid and (s.rid == rid or s.rid.startswith(f"{rid}_")))]
            for seq in hits:
                seq.abort_message = seq.abort_message or message
            self._dirty = True
            self._cond.notify_all()
        return len(hits)

    def abort_seqs(self, seqs: list[Sequence], message: str) -> None:
        with self._cond:
            for seq in seqs:
                if seq in self._live:
                    seq.abort_message = seq.abort_message or message
            self._dirty = True
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the model thread between decode steps; its result or error lands in the future."""
        fut: Future = Future()

        def job() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except Exception as err:  # handed to the caller, not swallowed
                fut.set_exception(err)

        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()
        return fut

    def load_weights(self, path: str, weight_version: str | None, load_format: str | None) -> Future:
        def job() -> weights.LoadReport:
            self.weights_ok = False
            try:
                report = weights.load_into(self.model, Path(path))
            except weights.WeightLoadError:
                self.stats.weight_load_failures += 1
                self._abort_everything("Weights are unknown after a failed weight update.")
                raise
            self.weights_ok = True
            self.model_path = path
            self.load_format = load_format or "auto"
            if weight_version is not None:
                self.weight_version = weight_version
            self.stats.weight_loads += 1
            return report

        return self.call(job)

    def set_weight_version(self, version: str) -> Future:
        return self.call(lambda: setattr(self, "weight_version", version))

    def pause(self, mode: str) -> Future:
        def job() -> None:
            self._paused = True
            if mode == "abort":
                self._abort_everything("Aborted by pause_generation.")
            elif mode == "retract":
                self._retract()

        return self.call(job)

    def resume(self) -> Future:
        return self.call(lambda: setattr(self, "_paused", False))

    def load(self) -> dict[str, int]:
        with self._cond:
            live = [s for s in self._live if not s.internal]
            running = sum(1 for s in self._batch.rows if not s.internal)
        return {
            "num_reqs": len(live),
            "num_running_reqs": running,
            "num_waiting_reqs": len(live) - running,
            "num_tokens": sum(len(s.prompt_ids) + len(s.output_ids) for s in live),
        }

    # ---- model thread ---------------------------------------------------------------------
    def _has_work(self) -> bool:
        busy = bool(self._pending or self._batch.rows) and not self._paused
        return self._stopping or bool(self._jobs) or self._dirty or busy

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                if self._stopping:
                    break
                jobs, self._jobs, self._dirty = self._jobs, [], False
            for job in jobs:
                job()
            self._sweep_aborts()
            if self._paused:
                continue
            try:
                self._admit_and_prefill()
                if self._batch.rows:
                    self._decode_step()
            except Exception as err:  # a model error fails the rows it hit; the loop survives
                log.exception("model step failed")
                for seq in self._batch.clear():
                    self._fail(seq, err)
        self._abort_everything("Engine shutting down.")

    def _sweep_aborts(self) -> None:
        abort = {"status_code": 200, "err_type": None}
        with self._cond:
            dropped = [s for s in self._pending if s.abort_message]
            if dropped:
                self._pending = deque(s for s in self._pending if not s.abort_message)
        for seq in dropped:
            seq.finish = {"type": "abort", "message": seq.abort_message, **abort}
            self._finalize(seq)
        for seq in self._batch.rows:
            if seq.abort_message and seq.finish is None:
                seq.finish = {"type": "abort", "message": seq.abort_message, **abort}
        self._drop_finished()

    def _abort_everything(self, message: str) -> None:
        with self._cond:
            for seq in self._live:
                seq.abort_message = seq.abort_message or message
        self._sweep_aborts()

    def _retract(self) -> None:
        rows = self._batch.clear()
        for seq in rows:
            seq.num_retractions += 1
        with self._cond:
            self._pending.extendleft(reversed(rows))

    def _admit_and_prefill(self) -> None:
        with self._cond:
            room = self.max_batch_size - len(self._batch)
            new = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
        try:
            self._prefill(new)
        except Exception as err:  # the newcomers are in no batch yet: fail them here, not silently
            rows = set(self._batch.rows)
            for seq in new:
                if seq not in rows:
                    self._fail(seq, err)
            raise

    def _prefill(self, new: list[Sequence]) -> None:
        for seq in new:
            if seq.logprobs is not None and not seq.logprobs.input_done:
                self._prompt_logprobs(seq, seq.logprobs)
        todo = []
        for seq in new:
            if seq.params.max_new_tokens == 0:
                seq.finish = {"type": "length", "length": 0}
                self._finalize(seq)
            else:
                todo.append(seq)
        if not todo:
            return
        first = len(self._batch)
        self.lora.rows = [s.lora for s in todo]
        logits = self._batch.prefill(todo)
        self.stats.prefill_batches += 1
        self.stats.max_prefill_batch_seen = max(self.stats.max_prefill_batch_seen, len(todo))
        for i, seq in enumerate(self._batch.rows[first:]):
            self._advance(seq, logits[i])
        self._drop_finished()

    def _prompt_logprobs(self, seq: Sequence, lp: Logprobs) -> None:
        """SGLang's input logprobs: tokens from `start_len` on, the first without a logprob."""
        lp.input_done = True
        start = lp.spec.start_len
        if start < 0 or start >= len(seq.prompt_ids):
            return
        self.lora.rows = [seq.lora]
        logprobs = torch.log_softmax(self._batch.full_logits(seq.prompt_ids).float(), dim=-1)
        logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
        ids = seq.prompt_ids
        lp.input_token = [(None, ids[start])]
        lp.input_top = [None]
        for pos in range(start + 1, len(ids)):
            row = logprobs[pos - 1]
            lp.input_token.append((float(row[ids[pos]]), ids[pos]))
            if lp.spec.top_n:
                lp.input_top.append(_top(row, lp.spec.top_n))

    def _decode_step(self) -> None:
        rows = self._batch.rows
        self.stats.max_batch_size_seen = max(self.stats.max_batch_size_seen, sum(not s.internal for s in rows))
        self.lora.rows = [s.lora for s in rows]
        logits = self._batch.step()
        self.stats.decode_steps += 1
        for i, seq in enumerate(rows):
            self._advance(seq, logits[i])
        self._drop_finished()

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample one token for `seq` from its logits row and decide whether it finished."""
        params = seq.params
        assert seq.generator is not None
        stop_ids = [*params.stop_token_ids, *([] if params.ignore_eos else self.eos_ids)]
        processed = decoding.processed_logits(logits, params, seq.prompt_ids, seq.output_ids, stop_ids)
        token = self._scripted(seq)
        if token is None:
            token = decoding.pick(processed, params, seq.generator)
        if seq.logprobs is not None:
            row = decoding.token_logprobs(processed, params)
            seq.logprobs.output_token.append((float(row[token]), token))
            if seq.logprobs.spec.top_n:
                seq.logprobs.output_top.append(_top(row, seq.logprobs.spec.top_n))
        seq.record_token(token, self.weight_version)
        text = self._decode(seq.output_ids, params.skip_special_tokens) if params.stop or params.stop_regex else None
        seq.finish = decoding.finish_reason(
            params, seq.output_ids, text, self.eos_ids, len(seq.prompt_ids), self.context_len
        )

    def _scripted(self, seq: Sequence) -> int | None:
        """The next scripted token of `seq` (then EOS), or None to sample from the model."""
        if seq.script is None:
            return None
        index = len(seq.output_ids)
        if index < len(seq.script):
            return seq.script[index]
        if seq.params.ignore_eos or not self.eos_ids or index < seq.params.min_new_tokens:
            return None
        return self.eos_ids[0]

    def _drop_finished(self) -> None:
        rows = self._batch.rows
        done = [s for s in rows if s.finish is not None]
        if done:
            self._batch.keep([i for i, s in enumerate(rows) if s.finish is None])
            for seq in done:
                self._finalize(seq)

    def _finalize(self, seq: Sequence) -> None:
        assert seq.finish is not None
        with self._cond:
            self._live.discard(seq)
        if not seq.internal:
            if seq.finish["type"] == "abort":
                self.stats.requests_aborted += 1
            else:
                self.stats.requests_finished += 1
            self.stats.tokens_generated += len(seq.output_ids)
        multi = len(seq.spans) > 1
        result = SeqResult(
            rid=seq.rid,
            text=decoding.output_text(self._decode, seq.output_ids, seq.params, seq.finish),
            output_ids=list(seq.output_ids),
            finish_reason=seq.finish,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            weight_version=str(seq.spans[-1][0]) if multi else self.weight_version,
            weight_versions=[{"version": v, "start": a, "end": b} for v, a, b in seq.spans] if multi else None,
            num_retractions=seq.num_retractions,
            e2e_latency=time.monotonic() - seq.created,
            prompt_ids=seq.prompt_ids,
            logprobs=seq.logprobs,
        )
        if not seq.future.done():
            seq.future.set_result(result)

    def _fail(self, seq: Sequence, err: Exception) -> None:
        with self._cond:
            self._live.discard(seq)
        if not seq.future.done():
            seq.future.set_exception(err)


def _top(row: torch.Tensor, n: int) -> Top:
    """The `n` best (logprob, token id) of one logprob row, best first."""
    values, ids = torch.topk(row, min(n, row.numel()))
    return [(float(v), int(i)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]
