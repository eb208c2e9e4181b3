"""Misbehaving reward functions, used as `custom:tests.reliability.rewards:<name>`."""


def says_yes(response: str, label: str) -> object:
    return "yes"  # not a number


def not_a_number(response: str, label: str) -> float:
    return float("nan")
