# The two commands of the quick start. Both set up .venv themselves (scripts/setup.sh).
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo demo-vlm test test-fast lint test-vllm docs

setup:
	@bash scripts/setup.sh

# The main job: a tiny model learns a calculator tool with SFT + RL on CPU (scripts/demo.sh).
demo: setup
	@bash scripts/demo.sh

# A tiny vision-language model learns to count shapes in pictures: SFT + RL on image prompts (scripts/demo_vlm.sh).
demo-vlm: setup
	@bash scripts/demo_vlm.sh

# Every test, the slow end-to-end ones included; lint first.
test: setup lint
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25

test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow"

lint: setup
	.venv/bin/ruff check .

# The docs site into build/site (strict: a broken link or reference fails; tests/test_docs.py builds it too).
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

# The vLLM engine's integration tier on vLLM's CPU build, in its own venv (.venv-vllm, ~3 min to set up
# once); a missing vllm there is an error, never a skip.
test-vllm:
	@bash scripts/setup_vllm.sh
	INSTAR_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q -rs -p no:cacheprovider tests/vllm
