"""Sweeps: a config's grid of trials (grid, hyper), run by any number of workers sharing one root folder (worker),
and read back into a table with its spread over seeds (results). `python -m lm_jax.sweep run|collect`, docs/sweeps.md.

Dependencies: config_lib, storage, workdir_lock (probing a trial's lock), obs.metrics_log; each trial runs as its own
`python -m lm_jax.main` process, so nothing here imports the trainer.
"""
