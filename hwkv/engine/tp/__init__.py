"""Tensor-parallel execution of the engine: the executor that starts the worker processes, the driver
and worker runners, the messages between them, the merge of the ranks' connector outputs
(docs/parallelism.md). The sharding rules, the communicator and the KV head mapping stay in
:mod:`hwkv.parallel`."""
