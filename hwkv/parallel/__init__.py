"""Tensor parallelism's building blocks: sharding rules, the communicator over torch.distributed and
the heterogeneous-TP KV head mapping (docs/parallelism.md); the engine's tensor-parallel execution
(executor, driver and worker runners) is :mod:`hwkv.engine.tp`."""
