"""Shared test fixtures. Servers bind 127.0.0.1 on free ports; whoever starts a process kills it by PID."""

from __future__ import annotations

import os
import socket

import pytest

# fixture modules shared by test folders (registered here, not imported into test modules)
pytest_plugins = ["tests.pointkit", "tests.deploykit", "tests.neighbour"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# in-process flows keep external backends in this process; a backend host is named by the tests that start one
os.environ.pop("PINNED_EVAL_BACKEND_HOST", None)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory):
    """One real `prefect server start` (SQLite, filesystem lease storage) for the whole test run.

    Yields the API URL; the process and its children are killed by PID at the end.
    """
    from tests.prefect_server import running_prefect_server

    with running_prefect_server(tmp_path_factory.mktemp("prefect-home")) as api_url:
        yield api_url
