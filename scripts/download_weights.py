#!/usr/bin/env python3
"""Download and verify the official GPT-2 weights into weights/: the same as `gpt2 download` (see --help).

    python scripts/download_weights.py [--repo openai-community/gpt2] [--revision main] [--dest weights/]
                                       [--format safetensors|bin]
"""

import sys

from gpt2_engine.cli import main

if __name__ == "__main__":
    sys.exit(main(["download", *sys.argv[1:]]))
