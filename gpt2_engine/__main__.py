"""`python -m gpt2_engine` is the `gpt2` command."""

import sys

from .cli import main

sys.exit(main())
