"""How `gpqa_labels_golden.jsonl` was produced: miles' own `gpqa` reward on two label families.

    python tests/data/gpqa_labels_golden.py PATH/TO/miles/rollout/rm_hub/gpqa.py > tests/data/gpqa_labels_golden.jsonl

The argument is miles' file itself (radixark/miles at 31f1ca9, `miles/rollout/rm_hub/gpqa.py`,
which imports only the standard library); it is imported alone from its path, never copied here.
Each case is one `(response, label, metadata)` of the product of the lists below, scored by
miles' `compute_gpqa_reward(response, label, metadata=metadata)` exactly as `rm_hub.async_rm`
calls it for `rm_type: gpqa` (a deep copy of the metadata: miles may add a key to it):

- `numeric`: labels miles reads as numbers, `int(label)` an index into the valid letters
  (integral and fractional floats, negative, past the last letter, NaN and infinities);
- `text`: string labels that are not a choice letter (the option's text in any case or
  punctuation, a letter in brackets or with a dot, a letter outside the valid ones, empty).

Fields: `id` (`<family>-<n>`), `response`, `label` (its JSON type kept), `metadata` (or null),
`miles_reward` (a float, null when miles raised), `raises` (the exception class, else null).
NaN and infinite labels are written as JSON's `NaN` / `Infinity` (Python's json reads them).
The lists are fixed: rerunning reproduces the file byte for byte.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import sys
from typing import Any

CHOICES = ["Paris", "London", "Rome", "Berlin"]
METADATA: list[dict[str, Any] | None] = [
    None,
    {"choices": CHOICES},
    {"choices": {"B": "London", "A": "Paris", "D": "Berlin", "C": "Rome"}},  # dict order, not its keys
    {"choices": ["Paris", "London", "Rome"]},
    {"choices": CHOICES, "valid_letters": ["W", "X", "Y", "Z"]},
    {"choices": [*CHOICES, "Madrid", "Oslo"], "valid_letters": ["a", "b", "c", "d"]},
    {"valid_letters": "ABCD"},
    {"correct_letter": "C"},
    {"correct_letter": " b ", "choices": CHOICES},
    {"correct_letter": "Z", "choices": CHOICES},
    {"correct_letter": 2, "choices": CHOICES},
    {"correct_letter": "", "choices": CHOICES},
    {"correct_answer": "Rome"},
    {"correct_answer": "Rome", "choices": CHOICES},
    {"answer_text": "Rome", "choices": CHOICES},
    {"correct_answer": "Paris", "answer_text": "Berlin"},
]
RESPONSES = [
    "Answer: C",
    "The answer is b",
    "I pick option D, since Rome is wrong.",
    "<think>It is A.</think> The capital is Rome.",
    "Rome!",
    "paris",
    "E",
    "none of these",
    "",
]
NUMERIC_LABELS: list[Any] = [0, 2, 3, 4, 7, 8, -1, 2.0, 2.5, 1.99, -0.5, -1.5, 1e20, float("nan"), float("inf")]
TEXT_LABELS: list[Any] = [
    "Rome", " rome! ", "ROME.", "Paris", "Madrid", "(C)", "C.", "c", "e", "Z", "AB", "2", "", "   ",
]


def _load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("miles_gpqa", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_gpqa_reward


def main(path: str) -> None:
    reward = _load(path)
    for family, labels in (("numeric", NUMERIC_LABELS), ("text", TEXT_LABELS)):
        for n, (label, metadata, response) in enumerate(itertools.product(labels, METADATA, RESPONSES)):
            row: dict[str, Any] = {"id": f"{family}-{n}", "response": response, "label": label, "metadata": metadata}
            try:
                value = reward(response, label, metadata=copy.deepcopy(metadata))
                row |= {"miles_reward": float(value), "raises": None}
            except Exception as exc:
                row |= {"miles_reward": None, "raises": type(exc).__name__}
            sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
