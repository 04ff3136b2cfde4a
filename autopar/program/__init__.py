"""The per-rank program: what it calls and what the passes that build it produce.

A rank's program (``autopar.passes.lower``, then the whole step: ``autopar.passes.joint``) is a
``torch.fx`` graph whose nodes call the functions defined here; the runtime (``autopar.runtime``)
runs it. Both import this package, neither imports the other:

* ``collectives`` — differentiable collectives per mesh axis (``AxisGroup``; the reshard steps,
  Megatron-LM's f/g);
* ``local_ops`` — local forms of ops whose inputs are sharded (vocabulary-parallel embedding and
  loss, the mean over a sharded dimension);
* ``experts`` — expert parallelism: the grouped matmul, the dispatch and combine all-to-alls;
* ``ring_attention`` — context parallelism's ring: attention with the keys and values passed
  around a mesh axis, and their gradients passed back;
* ``rng`` — random ops that recomputation runs twice: the generator's state recorded before the
  forward draw and replayed in backward;
* ``host_copies`` — activation offload's copies to host memory and back;
* ``kernels`` — the fused Triton kernels the fusion pass calls;
* ``records`` — ``StepProgram`` and ``StageStep``, the records the rank-program passes build.

Nothing here imports the planner, the solver, the cost model or the runtime.
"""
