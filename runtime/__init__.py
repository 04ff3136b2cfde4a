"""The runtime: execute a Plan on torch.distributed (gloo on CPU, NCCL on CUDA).

* ``collectives`` — differentiable collectives per mesh axis (the reshard steps, Megatron f/g);
* ``ops`` — local forms of ops whose inputs are sharded (vocab-parallel embedding and loss);
* ``module`` — ``parallelize`` and ``ParallelModule`` (parameters, state dicts, grad clipping);
* ``launch`` — ``spawn`` N local processes with a gloo group (tests, demo, benchmarks);
* ``compat`` — the torch-version differences in collective names;
* ``rng`` — random ops that recomputation runs twice: the generator's state recorded before the
  forward draw and replayed in backward.

Nothing here imports the solver (OR-Tools): a Plan saved as JSON runs without it.
"""
