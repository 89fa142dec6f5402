"""Runs on ranks: this rank's random number generators, read and set back (a snapshot keeps them).

torch's CPU generator, this rank's GPU's (where CUDA is in use), Python's `random` and NumPy's
(only where the user's code imported it): dropout masks and random data after a comeback are
then those of an uninterrupted run.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

from . import membership


def capture() -> dict[str, Any]:
    """This rank's generators as they are now (a few KiB)."""
    found: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    gpu = _gpu()
    if gpu is not None:
        found["cuda"] = torch.cuda.get_rng_state(gpu)
    numpy = sys.modules.get("numpy")  # only where the user's code imported it
    if numpy is not None:
        found["numpy"] = numpy.random.get_state()
    return found


def set_back(saved: dict[str, Any]) -> None:
    """The generators as `capture` read them (on this rank or another)."""
    if "torch" in saved:
        torch.set_rng_state(saved["torch"])
    if "python" in saved:
        random.setstate(saved["python"])
    gpu = _gpu()
    if "cuda" in saved and gpu is not None:
        torch.cuda.set_rng_state(saved["cuda"], gpu)  # the sender's GPU generator onto this rank's GPU
    if "numpy" in saved:
        import numpy

        numpy.random.set_state(saved["numpy"])


def _gpu() -> torch.device | None:
    """This rank's GPU, where it has one and CUDA is in use (never the first CUDA call)."""
    context = membership.joined_context()
    if context is None or context.device.type != "cuda" or not torch.cuda.is_initialized():
        return None
    return context.device
