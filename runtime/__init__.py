"""The runtime: run what the per-rank compiler built from a Plan on torch.distributed (gloo on CPU,
NCCL on CUDA).

* ``module`` — ``ParallelModule``: this rank's shards of the model, running its step record
  (``RankStep``) — the pipeline's schedule, the captured step, or the forward program;
* ``shards`` — what each program input is bound to, and this rank's pieces of the tensors;
* ``inputs`` — each call's inputs: sharded, checked against the plan, agreed between the ranks;
* ``state`` — full and sharded state dicts, gradient clipping;
* ``world`` — the ranks and their process groups: the world checked against the plan, rank 0's
  plan broadcast, one group per mesh axis;
* ``step_runner`` — runs a rank's ``StepProgram`` (``bind_step``, ``run_step``) under the user's
  autograd;
* ``pipeline_runner`` — runs this rank's pipeline stages (``PipelineRunner``, ``build_runner``);
* ``checkpoint`` — sharded DCP save and load under any plan;
* ``monitor`` — every wait of a step through one monitor: timing, timeouts, a peer's failure;
* ``launch`` — ``spawn`` N local processes with a gloo group (tests, demo, benchmarks);
* ``link_emulation`` — local processes as nodes joined by a slower link (``emulate_nodes``): a
  bench for predictions of clusters of several nodes;
* ``calibrate`` — measure this machine (``autopar.cost.calibration`` fits the model to it);
* ``compat`` — the torch-version differences in collective names.

What a rank's program calls (collectives, local ops, expert dispatch, the RNG replay, the fused
kernels) and the records the passes build are ``autopar.program``'s. The runtime imports only
those and the data layer: never the planner, the solver (OR-Tools: a Plan saved as JSON runs
without it), the rules, the passes or the cost model (``tests/test_layers.py``).
"""
