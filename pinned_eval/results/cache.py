"""The generation cache key: what must be equal for stored generations to stand for new ones.

`generation_key` hashes (sha256 over canonical JSON):
- the snapshot digest (`snapshot_digest`), and the LoRA base's when an adapter is served over it;
- the weight version every request pinned;
- per dataset: its name, its digest (every loaded row: index, prompt, label, metadata, in order),
  its sampling parameters (temperature, top_p, top_k, max_new_tokens, stop), samples per prompt
  and its prompt rendering (input key, chat template on/off, template kwargs, system prompt);
- the chat template: the tokenizer files (`tokenizer_config.json`, `tokenizer.json`,
  `chat_template.jinja`, `chat_template.json`) of the tokenizer directory, when any dataset
  applies the template.
Rewards are not part of the key: re-scoring is what the cache is for.

`snapshot_digest` is cheap (never reads tensor data): when the snapshot's `.complete` marker holds
a pinned-eval manifest, the digest of its export id, index digest, total size and file sizes; else
(a bare marker, a base checkpoint) the name, size and modification time of every file, plus each
`.safetensors` file's header (which carries the export id pinned-eval writes). It identifies one
export, not weight values: a re-export of identical weights is a cache miss (regenerates), never a
hit on other weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pinned_eval.datasets.loader import EvalSample
from pinned_eval.datasets.spec import ResolvedDataset
from pinned_eval.snapshot.layout import MARKER, RETIRED, Manifest

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "chat_template.jinja", "chat_template.json")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own bound on a header


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def snapshot_digest(path: str | Path) -> str:
    """Digest of the local snapshot directory `path` (see the module docstring)."""
    root = Path(path)
    marker = root / MARKER
    if marker.is_file():
        try:
            m = Manifest.model_validate_json(marker.read_bytes())
        except ValueError:
            m = None  # a bare marker: judged by the files themselves
        if m is not None:
            return _sha({"manifest": [m.export_id, m.index_sha256, m.total_size, m.files]})
    files = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name in (MARKER, RETIRED) or not entry.is_file():
            continue
        st = entry.stat()
        header = _safetensors_header(entry.path) if entry.name.endswith(".safetensors") else ""
        files.append([entry.name, st.st_size, st.st_mtime_ns, header])
    return _sha({"files": files})


def _safetensors_header(path: str) -> str:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            return ""
        (n,) = struct.unpack("<Q", raw)
        return hashlib.sha256(f.read(min(n, _MAX_HEADER))).hexdigest()


def dataset_digest(rows: Sequence[EvalSample]) -> str:
    return _sha([[s.index, s.prompt, s.label, s.metadata] for s in rows])


def chat_template_digest(tokenizer_dir: str | None) -> str | None:
    """Digest of the tokenizer files present in `tokenizer_dir` (None: no local directory)."""
    if tokenizer_dir is None or not Path(tokenizer_dir).is_dir():
        return None
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        p = Path(tokenizer_dir) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def generation_key(
    snapshot: str,
    weight_version: str,
    datasets: Sequence[ResolvedDataset],
    rows: Mapping[str, Sequence[EvalSample]],
    tokenizer_dir: str | None,
    lora_base: str | None = None,
) -> str:
    """The cache key of one point's generations (see the module docstring)."""
    templated = any(ds.apply_chat_template for ds in datasets)
    return _sha(
        {
            "snapshot": snapshot,
            "lora_base": snapshot_digest(lora_base) if lora_base else None,
            "weight_version": weight_version,
            "chat_template": chat_template_digest(tokenizer_dir) if templated else None,
            "datasets": [
                {
                    "name": ds.name,
                    "rows": dataset_digest(rows[ds.name]),
                    "sampling": ds.sampling_params(),
                    "n": ds.n_samples_per_prompt,
                    "render": [ds.input_key, ds.apply_chat_template, ds.apply_chat_template_kwargs, ds.system_prompt],
                }
                for ds in datasets
            ],
        }
    )
