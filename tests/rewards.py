"""Reward functions used by tests through `custom:tests.rewards:<name>`."""


def explode(response: str, label: str) -> float:
    raise RuntimeError("reward function failed on purpose")
