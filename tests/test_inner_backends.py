"""Which inner backend serves each device (``recovery/process_group/init_hook.py``), and the NCCL
backend options a generation is built with (``recovery/process_group/nccl_inner.py``).

This host's torch has no NCCL, so the options are built from stand-ins of torch's
``ProcessGroupNCCL.Options`` shape (a ``config`` with a ``blocking`` field, as torch's
bindings declare it); that a real communicator accepts them is the GPU check's
one-rank generation cycle (``make test-gpu``).
"""

from __future__ import annotations

import datetime

from recovery.process_group import nccl_inner


class _Config:
    def __init__(self) -> None:
        self.blocking = 1  # NCCL's default: a blocking communicator
        self.min_ctas = 4


class _Options:
    def __init__(self) -> None:
        self.config = _Config()
        self._timeout = datetime.timedelta(minutes=10)


class _OldOptions:
    """A torch whose options have no ``config``: the timeout is all there is to set."""

    def __init__(self) -> None:
        self._timeout = datetime.timedelta(minutes=10)


def test_a_generation_communicator_is_non_blocking_with_the_collective_timeout() -> None:
    opts = nccl_inner.nccl_options(_Options, 42.0)
    assert opts.config.blocking == nccl_inner.NON_BLOCKING == 0
    assert opts.config.min_ctas == 4  # the rest of NCCL's config untouched
    assert opts._timeout == datetime.timedelta(seconds=42.0)


def test_options_without_a_config_keep_the_timeout() -> None:
    opts = nccl_inner.nccl_options(_OldOptions, 7.5)
    assert opts._timeout == datetime.timedelta(seconds=7.5)


def test_the_fixed_algorithm_keeps_what_the_user_set() -> None:
    env: dict[str, str] = {"NCCL_PROTO": "LL128"}
    nccl_inner.pin_algorithm(env)
    assert env == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL128"}


def test_an_abort_that_raises_is_dropped_and_shrinking_is_feature_detected() -> None:
    calls = []

    class Broken:
        def abort(self) -> None:
            calls.append("abort")
            raise RuntimeError("NCCL error: remote process exited")

    class Shrinkable:
        supports_shrinking = True

    nccl_inner.abort(Broken())
    assert calls == ["abort"]
    assert nccl_inner.can_shrink(Shrinkable())
    assert not nccl_inner.can_shrink(Broken())  # no attribute: an older torch


def test_a_gloo_script_on_a_gpu_host_gets_gloo_for_cuda_tensors_too(monkeypatch) -> None:
    """``init_process_group("gloo")`` takes CUDA tensors in torch (through host copies):
    under the runtime a bare ``gloo`` covers the ``cuda`` device where CUDA exists, and
    stays CPU-only elsewhere (no second inner group per generation on CPU hosts)."""
    import torch

    from recovery.process_group.init_hook import inner_backends_for

    assert inner_backends_for("gloo") == {"cpu": "gloo"}  # this host: no CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert inner_backends_for("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert inner_backends_for("nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert inner_backends_for(None) == {"cpu": "gloo", "cuda": "nccl"}
