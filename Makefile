# The two commands a new user needs: `make demo` and `make test`.
.PHONY: setup services demo test lint bench clean

setup:
	./scripts/setup.sh

# system packages the tests drive for real (Chromium, PostgreSQL); installed when missing and root
services:
	./scripts/ci-services.sh

demo: setup
	.venv/bin/pinned-eval demo

test: setup services
	.venv/bin/python -m pytest -q -p no:cacheprovider

lint:
	.venv/bin/ruff check . && .venv/bin/mypy

bench: setup
	.venv/bin/python -m bench

clean:
	rm -rf .venv .pytest_cache build *.egg-info
