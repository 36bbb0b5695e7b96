"""Tensor parallelism: sharding rules, the communicator over torch.distributed, the driver/worker
runners and processes, and the heterogeneous-TP KV head mapping (docs/parallelism.md)."""
