# The two commands a new user needs (README):
#   make demo   - set up, build the demo model, serve one prompt without and with the connector, compare
#   make test   - set up, run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dhisparse-installed

.PHONY: test test-gpu demo setup clean

$(STAMP): setup.py scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=30

# on a CUDA machine (SM90 / SM100) with vLLM 0.33 and this package installed in PYTHON's
# environment: the connector against resident serving inside vLLM's GPU engine
PYTHON ?= python3
test-gpu:
	$(PYTHON) -m pytest -q -p no:cacheprovider -rs tests/gpu

demo: $(STAMP)
	$(PY) -m vllm_dhisparse.demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) demo_model
