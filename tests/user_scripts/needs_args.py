"""A newcomer's script with command-line flags, started with one it does not know."""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()
print(f"training for {args.steps} steps")
