# The two commands a new user needs: `make demo` and `make test`.
.PHONY: setup demo test lint bench clean

setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/pinned-eval demo

test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider

lint:
	.venv/bin/ruff check . && .venv/bin/mypy

bench: setup
	.venv/bin/python -m bench

clean:
	rm -rf .venv .pytest_cache build *.egg-info
