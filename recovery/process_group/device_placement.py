"""Which GPU a rank uses: ``cuda:(LOCAL_RANK % device_count)``, unless the script chose.

torchrun leaves the choice to the script, and most scripts make it
(``torch.cuda.set_device(local_rank)``). One that does not would put every local rank on
device 0, where NCCL refuses a second rank; and a replacement, which takes over the dead
rank's ``LOCAL_RANK``, must land on the GPU that rank left, whatever the script did
before it. So the runtime makes the choice at its start (:func:`place`) where the
script has not. The rule:

- no CUDA build, or no device visible: nothing to do;
- one visible device (``CUDA_VISIBLE_DEVICES`` narrowed to the rank's GPU, by the user
  or the scheduler): it is the only choice, nothing to do;
- the script chose already, and its choice stands: the current device is not the
  default (CUDA is initialised and ``current_device() != 0``: ``set_device``, or a
  ``torch.cuda.device`` block around the runtime's start), the default device is an
  explicit GPU (``torch.set_default_device("cuda:N")``), or the model handed to the
  runtime already lives on a GPU (moving the current device away from it would split
  the rank's state across two GPUs);
- otherwise the current device becomes ``LOCAL_RANK % device_count``: at once where
  CUDA is initialised, else when it initialises, before its first use (torch queues its
  own deferred CUDA calls, such as seeding, the same way), so that a job training on
  the CPU of a GPU host never initialises CUDA for it. Device 0, the default, needs no
  call.

A framework that places its ranks itself (Lightning's ``Trainer(devices=[1, 0])`` puts
local rank 1 on ``cuda:0``) says so with :func:`chosen` before the runtime starts; its
choice then stands, ``cuda:0`` included.

A warm spare has initialised CUDA before it knew its rank (:func:`launcher.spare.warm_cuda`)
and left the current device at 0, so it is placed by the last rule like a fresh process.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch

_framework_choice: int | None = None


def chosen(index: int) -> None:
    """The framework running the script placed this rank on ``cuda:index`` itself:
    :func:`place` leaves it there (for the rest of the process's life)."""
    global _framework_choice
    _framework_choice = index


def place(local_rank: int, model: Any = None) -> int | None:
    """Make ``cuda:(local_rank % device_count)`` the current device unless the script
    chose one (see the module's rule); returns the device index set, else None."""
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if count <= 1 or _script_chose(model):
        return None
    index = local_rank % count
    if index == 0:
        return index
    if torch.cuda.is_initialized() or not hasattr(torch.cuda, "_lazy_call"):
        torch.cuda.set_device(index)
    else:
        torch.cuda._lazy_call(functools.partial(torch.cuda.set_device, index))
    return index


def _script_chose(model: Any) -> bool:
    if _framework_choice is not None:
        return True
    if torch.cuda.is_initialized() and torch.cuda.current_device() != 0:
        return True
    get_default = getattr(torch, "get_default_device", None)  # torch >= 2.3
    default = get_default() if get_default is not None else None
    if default is not None and default.type == "cuda" and default.index is not None:
        return True
    return _on_gpu(model)


def _on_gpu(model: Any) -> bool:
    """Whether any parameter or buffer of ``model`` (a ``torch.nn.Module``) is on a GPU."""
    params = getattr(model, "parameters", None)
    buffers = getattr(model, "buffers", None)
    if params is None or buffers is None:
        return False
    return any(t.device.type == "cuda" for t in itertools.chain(params(), buffers()))
