"""Running one model over several processes on MLX's distributed backend.

`mx.distributed` is the transport (ring over TCP / Thunderbolt, MPI, NCCL on CUDA
builds); ds4mlx only decides what each rank holds and where the partial results meet:

* plan.py      `Plan` (tp | ep | pipeline, rank, size) and the process group (`init`);
* slicing.py   one tensor's part for this rank, taken before it is read (mapped views,
               GGUF blocks, MX bytes, MLX arrays, lazy tensors);
* deepseek_v4.py the V4 family's plans: its config and weight names per rank and the
               modules whose outputs are summed (tp, ep) or handed on (pipeline);
* sharding.py  `Sharding(plan, group)`: the loader's hook (config, weights, modules);
* follower.py  rank 0 leads: every session command it runs is broadcast as a step
               command (op code + tokens) and the other ranks replay it.
"""
