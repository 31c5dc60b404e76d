"""``python -m genfn.serve``: the same server as ``genfn serve``."""

import argparse
import sys

from genfn.serve.command import add_arguments, main

if __name__ == "__main__":
    parser = add_arguments(argparse.ArgumentParser(prog="python -m genfn.serve",
                                                   description="An OpenAI-compatible server over one model."))
    sys.exit(main(parser.parse_args()))
