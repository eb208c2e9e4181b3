"""The app layer: the `pinned-eval` CLI, the demo, the local stack, history and reports (imports every layer below)."""
