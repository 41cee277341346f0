"""The end of a rank of the 2-process tests (the ``*_worker.py`` scripts), once it has written its results."""

from __future__ import annotations

import gc
import os
import sys
from typing import NoReturn

import torch.distributed as dist


def end_rank(status: int = 0) -> NoReturn:
    """Wait for the other rank, destroy the process group and end this process with ``status`` at once, without the
    interpreter's teardown: there gloo's threads were destroyed while still joinable now and then (``terminate called
    without an active exception``, SIGABRT after the results were written: ~4 runs in 10 of one worker before the
    barrier, and still ~1 full suite in 10 after it, collecting what holds the group first included). The caller drops
    its own references to models and optimizers first."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
