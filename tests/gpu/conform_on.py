"""attention-multi conform with torch's default device set, so that the grid's
arrays (made by torch.tensor) live on it. usage: conform_on.py DEVICE ARGS..."""

import sys

import torch

from attention_multi.cli import main

torch.set_default_device(sys.argv[1])
sys.exit(main(["conform", *sys.argv[2:]]))
