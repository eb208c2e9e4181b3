# The two commands a new user needs: `make demo` and `make test`.
.PHONY: setup services demo test lint bench mutants clean

setup:
	./scripts/setup.sh

# system packages the tests drive for real (Chromium, PostgreSQL); installed when missing and root
services:
	./scripts/ci-services.sh

demo: setup
	.venv/bin/pinned-eval demo

# lint first: a style or type error fails CI in seconds, before the 15-minute suite
test: setup services
	.venv/bin/ruff check . && .venv/bin/mypy && .venv/bin/lint-imports
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30

lint: setup
	.venv/bin/ruff check . && .venv/bin/mypy && .venv/bin/lint-imports

bench: setup
	.venv/bin/python -m bench

# mutation testing of the invariant modules (docs/testing.md); not part of `make test`: tens of minutes
mutants: setup
	.venv/bin/python scripts/mutants.py

clean:
	rm -rf .venv .pytest_cache .import_linter_cache build *.egg-info mutants
