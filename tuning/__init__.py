"""The Optuna autotuning harness behind ``lab tune``: knows tiles only through the contract in :mod:`tiles.core.contract`."""
