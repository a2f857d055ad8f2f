# `make report`: set up the legacy stack (all four backends) and run the report.
# `make test`:   set up both stacks and run the whole suite on each, then `make check`.
# `make check`:  lint (ruff), formatting (ruff format), types (mypy), the docs site (strict).
# `make docs`:   build the documentation site into site/ (open site/index.html).
PYTHON ?= python3
LEGACY := .venv-legacy
MODERN := .venv-modern
LINT := .venv-lint
PYTEST := python -m pytest -q -p no:cacheprovider

.PHONY: report test test-legacy test-modern check docs

report: $(LEGACY)/ready
	$(LEGACY)/bin/attention-multi report

test: test-legacy test-modern check

# Every CPU backend is required on the legacy stack: a missing one fails.
test-legacy: $(LEGACY)/ready
	ATTENTION_MULTI_REQUIRE=numpy,torch,jax,mxnet $(LEGACY)/bin/$(PYTEST)

# MXNet cannot be installed with numpy 2: its cases skip with a reason.
test-modern: $(MODERN)/ready
	ATTENTION_MULTI_REQUIRE=numpy,torch,jax $(MODERN)/bin/$(PYTEST)

# Each gate runs even when an earlier one fails; check fails if any did.
check: $(LINT)/ready
	@status=0; \
	for gate in "ruff check ." "ruff format --check ." "mypy" "mkdocs build --strict --quiet"; do \
		echo "== $$gate"; \
		NO_MKDOCS_2_WARNING=1 $(LINT)/bin/$$gate || status=1; \
	done; \
	exit $$status

docs: $(LINT)/ready
	NO_MKDOCS_2_WARNING=1 $(LINT)/bin/mkdocs build --strict
	@echo "the site is in site/: open site/index.html"

.venv-%/ready: requirements/%.txt pyproject.toml
	rm -rf .venv-$*
	$(PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q -r requirements/$*.txt
	.venv-$*/bin/python -m pip install -q --no-deps -e .
	touch $@
