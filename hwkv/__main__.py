"""`python -m hwkv ...` is the `hwkv` command."""

import sys

from hwkv.cli import main

sys.exit(main())
