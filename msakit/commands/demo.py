"""`msakit demo`: the main job (see `msakit.train.demo`)."""

from msakit.train.demo import add_parser

__all__ = ["add_parser"]
