# `make report`: set up the legacy stack (all four backends) and run the report.
# `make test`:   set up both stacks and run the whole suite on each.
PYTHON ?= python3
LEGACY := .venv-legacy
MODERN := .venv-modern
PYTEST := python -m pytest -q -p no:cacheprovider

.PHONY: report test test-legacy test-modern

report: $(LEGACY)/ready
	$(LEGACY)/bin/attention-multi report

test: test-legacy test-modern

# Every CPU backend is required on the legacy stack: a missing one fails.
test-legacy: $(LEGACY)/ready
	ATTENTION_MULTI_REQUIRE=numpy,torch,jax,mxnet $(LEGACY)/bin/$(PYTEST)

# MXNet cannot be installed with numpy 2: its cases skip with a reason.
test-modern: $(MODERN)/ready
	ATTENTION_MULTI_REQUIRE=numpy,torch,jax $(MODERN)/bin/$(PYTEST)

.venv-%/ready: requirements/%.txt pyproject.toml
	rm -rf .venv-$*
	$(PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q -r requirements/$*.txt
	.venv-$*/bin/python -m pip install -q --no-deps -e .
	touch $@
