# On the path of the Megatron test ranks only (tests/distributed/test_launch.py: megatron_env). Megatron imports
# transformers for its HuggingFace tokenizer and carries on without it (ModuleNotFoundError); these runs use
# NullTokenizer, and transformers' import costs each rank about a CPU-second of the 2-core test machine.
raise ModuleNotFoundError("transformers is left out of the Megatron test ranks (tests/distributed/test_launch.py)")
