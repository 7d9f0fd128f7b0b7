"""Deprecated: ``python -m fp4_dist.megatron.pretrain_gpt`` runs ``python -m examples.megatron_pretrain_gpt``."""

if __name__ == "__main__":
    from .._moved import run_moved_example

    run_moved_example("fp4_dist.megatron.pretrain_gpt", "examples.megatron_pretrain_gpt")
