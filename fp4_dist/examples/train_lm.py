"""Deprecated: ``python -m fp4_dist.examples.train_lm`` runs ``python -m examples.train_lm``."""

if __name__ == "__main__":
    from .._moved import run_moved_example

    run_moved_example("fp4_dist.examples.train_lm", "examples.train_lm")
