# `make report`: set up the legacy stack (all four backends) and run the report.
# `make test`:   the suite on each stack and `make check`, all three at once, each job
#                building its venv first (in parallel) (.ci/test_all.py: progress, summary):
#                the fast matrix on legacy, what differs on modern (conftest.py's tiers).
# `make test-all`: the same with the full matrix on both stacks (every row on every backend).
# `make mutants`: plant the bugs of .ci/mutants.py one at a time in a copy of the tree and show
#                that the fast suite fails on each one the full matrix fails on.
# `make check`:  lint (ruff), formatting (ruff format), types (mypy), the docs site (strict).
# `make docs`:   build the documentation site into site/ (open site/index.html).
# `make peers`:   the peers' conformance rows, Keras 3 and flax, in their own venv (.venv-peers,
#                pinned in requirements/peers.txt): the whole grid each, into .venv-peers/results/.
PYTHON ?= python3
LEGACY := .venv-legacy
MODERN := .venv-modern
LINT := .venv-lint
PEERS := .venv-peers
# every core, a test file per worker (module fixtures run once)
PYTEST := python -m pytest -q -p no:cacheprovider -n auto --dist loadfile --durations=20
SHELL := /bin/bash

.PHONY: report test test-all mutants venvs test-legacy test-modern check docs peers

report: $(LEGACY)/ready
	$(LEGACY)/bin/attention-multi report

# (each of the three jobs builds its own venv first: a stack's suite starts
# as soon as its venv is ready, while the others still install)
test:
	@$(PYTHON) .ci/test_all.py

# every row of every test on every backend, on both stacks
test-all:
	@ATTENTION_MULTI_MATRIX=full $(PYTHON) .ci/test_all.py

mutants: $(LEGACY)/ready
	@$(PYTHON) .ci/mutants.py

venvs: $(LEGACY)/ready $(MODERN)/ready $(LINT)/ready

# Every CPU backend is required on the legacy stack: a missing one fails.
test-legacy: $(LEGACY)/ready
	ATTENTION_MULTI_REQUIRE=numpy,torch,jax,mxnet $(LEGACY)/bin/$(PYTEST)

# MXNet cannot be installed with numpy 2: its cases skip with a reason. The
# second stack runs what differs there (--stack=second; ATTENTION_MULTI_MATRIX=full: all).
test-modern: $(MODERN)/ready
	ATTENTION_MULTI_REQUIRE=numpy,torch,jax,tensorflow,transformers,flax $(MODERN)/bin/$(PYTEST) --stack=second

# Each gate runs even when an earlier one fails; check fails if any did.
check: $(LINT)/ready
	@status=0; \
	for gate in "ruff check ." "ruff format --check ." "mypy" "mkdocs build --strict --quiet"; do \
		echo "== $$gate"; \
		if NO_MKDOCS_2_WARNING=1 $(LINT)/bin/$$gate; then echo "-- $$gate: ok"; \
		else echo "-- $$gate: FAILED"; status=1; fi; \
	done; \
	exit $$status

docs: $(LINT)/ready
	NO_MKDOCS_2_WARNING=1 $(LINT)/bin/mkdocs build --strict
	@echo "the site is in site/: open site/index.html"

# Each peer's grid runs even when the other's fails; peers fails if either did.
peers: $(PEERS)/ready
	@mkdir -p $(PEERS)/results; status=0; \
	for impl in keras flax; do \
		$(PEERS)/bin/python -m attention_multi conform --impl $$impl \
			--json $(PEERS)/results/$$impl.json --markdown $(PEERS)/results/$$impl.md \
			> /dev/null || status=1; \
	done; \
	echo "the tables are in $(PEERS)/results/ (keras.md, flax.md; and JSON)"; \
	exit $$status

# One line per package while pip works (several venvs build at once with -j).
.venv-%/ready: requirements/%.txt pyproject.toml requirements/numpy_bool_for_mxnet.pth
	@echo "[venv $*] building .venv-$* from requirements/$*.txt"
	@start=$$(date +%s); set -o pipefail; \
	rm -rf .venv-$* && $(PYTHON) -m venv .venv-$* && \
	PYTHONUNBUFFERED=1 .venv-$*/bin/python -m pip install --progress-bar off --prefer-binary \
		-r requirements/$*.txt \
		| { grep --line-buffered -E "^(Collecting|Installing|Successfully)" || true; } \
		| sed -u -e "s/^/[venv $*] /" -e "s/ (from -r .*//" && \
	.venv-$*/bin/python -m pip install -q --no-deps -e . && \
	if grep -q "^mxnet" requirements/$*.txt; then \
		cp requirements/numpy_bool_for_mxnet.pth "$$(.venv-$*/bin/python -c \
			'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"; \
	fi && \
	touch $@ && echo "[venv $*] ready in $$(( $$(date +%s) - start )) s"
