"""``hwkv`` subcommands: each module exposes ``add_arguments(parser)`` and ``run(args) -> int``
(see :mod:`hwkv.cli`)."""
