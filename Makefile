# Two commands set everything up on a fresh CPU machine:
#   make demo   - builds .venv and runs the main job on its embedded default
#   make test   - builds .venv and runs the test suite (kernels under TRITON_INTERPRET=1)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU pins: these wheels lie on the project's machines' local disk.
CPU_PINS := torch==2.13.0 triton==3.6.0 "numpy<2.4"
# pytest-xdist workers for `make test` (the tests' conftest gives each one torch thread)
TEST_WORKERS ?= 2

.PHONY: venv demo test clean

$(BIN)/.stamp: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(CPU_PINS)
	$(BIN)/python -m pip install -q -e ".[train,hf,test]"
	touch $@

venv: $(BIN)/.stamp

demo: venv
	$(BIN)/msakit demo

test: venv
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) tests

clean:
	rm -rf $(VENV)
