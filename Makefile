# The two commands a newcomer needs (see README.md): `make demo` and `make test`.
# Both create the virtual environment .venv in the repo root on first use.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.test-installed
# The rendezvous port of the multi-rank targets (make demo MASTER_PORT=29600). Empty (the
# default): torchrun's --standalone picks a free one, so a second job on the machine does not
# collide with the first.
MASTER_PORT ?=
RENDEZVOUS := $(if $(MASTER_PORT),--master-addr 127.0.0.1 --master-port $(MASTER_PORT),--standalone)
# setuptools' note that an editable install imports from the working tree (which is what it is
# for): that one message, which a user cannot act on, is not shown.
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation.:UserWarning"

.PHONY: install demo layer-demo test clean

$(STAMP): pyproject.toml requirements.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(QUIET_EDITABLE) $(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# The main job: a short GPT-2 MoE pretraining on CPU, 4 ranks (tp=2, ep=2), dispatcher `parm`,
# on the shipped corpus; prints falling loss, ends with where the checkpoint and logs are.
demo: install
	PYTHON=$(PY) MASTER_PORT=$(MASTER_PORT) pretrain_scripts/run_local.sh

# A 4-rank forward/backward of one MoE layer with every dispatcher, side by side.
layer-demo: install
	$(PY) -m megatron_parm.launch --nproc-per-node 4 $(RENDEZVOUS) tools/bench_moe_layer.py \
		--tensor-model-parallel-size 2 --expert-model-parallel-size 2 \
		--expert-tensor-parallel-size 2 --sequence-parallel

# The test extra of pyproject.toml on top (transformers: the reference of the Hugging Face
# conversion tests; the installed torch and megatron-core already satisfy the rest).
$(TEST_STAMP): $(STAMP) pyproject.toml
	$(QUIET_EDITABLE) $(PY) -m pip install -q -e '.[test]'
	touch $(TEST_STAMP)

test: $(TEST_STAMP)
	$(PY) -m pytest -q --durations=25 tests

clean:
	rm -rf $(VENV) .pytest_cache
