"""Deprecated home of the example applications, now ``examples/`` at the repository root (not installed).

    train_lm.py  ``python -m fp4_dist.examples.train_lm`` warns and runs ``python -m examples.train_lm`` from a
                 checkout of the repository, or stops naming that command where no ``examples/`` sits beside the
                 package (`fp4_dist._moved`; one release of grace, then this package goes)
"""
