# The two commands a new user needs (README):
#   make demo   - set up, build the demo model, serve one prompt without and with the connector, compare
#   make test   - set up, run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dhisparse-installed

.PHONY: test demo setup clean

$(STAMP): setup.py scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=30

demo: $(STAMP)
	$(PY) -m vllm_dhisparse.demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) demo_model
