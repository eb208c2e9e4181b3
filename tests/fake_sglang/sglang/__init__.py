"""A GPU-free stand-in for the `sglang` package, put on a launched engine's PYTHONPATH by tests
only (never importable from the test process itself): see `launch_server`."""
