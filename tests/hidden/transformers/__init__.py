"""Stands in for `transformers` in the processes the tests start (tests/conftest.py puts
tests/hidden first on their PYTHONPATH): importing it fails as if the package were not
installed.

`transformers` is a test-only package, the reference the Hugging Face tests compare against in
the pytest process. Training, the tools and the ranks never need it (`make demo` installs
without it), but Megatron-Core 0.16.1's tokenizer package imports it whenever it is installed
(megatron/core/tokenizers/text/libraries/huggingface_tokenizer.py, inside a try), about a fifth
of a rank's start-up. So the ranks and tools the tests start run as a `make demo` install
would. A process that needs it (a documented command, tools/tiny_hf_model.py) is started with
launch.without_hidden(env).
"""

raise ModuleNotFoundError("transformers is hidden from the processes the tests start "
                          "(tests/hidden/transformers)", name="transformers")
