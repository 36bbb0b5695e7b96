"""The toy plugin's bench module (``hwkv bench tp-toy-bench``)."""


def add_arguments(p):
    p.add_argument("--n", type=int, default=1)


def run(args):
    return 40 + args.n
