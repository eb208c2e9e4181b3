"""`python -m engine --model-path DIR --port P ...`: the same as `pinned-eval engine serve`."""

import typer

from engine.cli import serve

if __name__ == "__main__":
    typer.run(serve)
