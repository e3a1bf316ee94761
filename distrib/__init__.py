"""Training: the one training loop (`trainer.fit`) and the `compress train` job (`job.run`).

Data-parallel strategies on torch.distributed (all-reduce, parameter server) build on these.
Depends on `models` only; never on `compressor` or `cli`.
"""
