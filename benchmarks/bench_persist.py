"""Durable persistence cost, side by side with the alternatives, in one run.

A model whose training state (fp32 weights, Adam's two moments, RNG) is ``--mb`` MB
is snapshotted once per repetition and handed to :class:`DurableWriter` configured as
the runtime configures it: the snapshot engine keeps three slots in shared memory and
the writer is zero-copy (its helper process writes straight from the slot; the
training process copies nothing). Every figure is measured in this run on the same
bytes, as medians over interleaved repetitions:

- ``persist_block_s``: the caller's blocking time per persisted step beyond the
  snapshot, i.e. the time spent in ``DurableWriter.submit``; ``release_s``: from
  ``submit`` until the writer releases the caller's buffer (zero-copy: when the save is
  over; the runtime holds that slot meanwhile and captures into the two others);
- ``torch_save_fsync_s``: a synchronous ``torch.save`` of the same state plus fsync,
  what a loop without a background writer blocks for; ``block_over_sync`` their ratio;
- ``persist_s``: from ``submit`` until this rank's DCP checkpoint, sidecar, done file
  and the manifest are durable, with the training loop idle; ``raw_write_s``: one
  plain sequential write plus fsync of the snapshot's bytes; ``persist_over_raw_write``;
- ``persist_caller_cpu_s``: CPU seconds the training process itself spends on one
  persist (every thread; the helper's work excluded), and
  ``staged_persist_caller_cpu_s`` the same through a staging copy: unlike the
  throughput ratios below, these barely depend on what else the host runs;
- ``throughput_during_persist_ratio``: steps/s of a small CPU training loop (one torch
  thread) while a persist runs in the background, over steps/s of the same loop in an
  idle gap of the same length right after it; persists (the same snapshot, under new
  step numbers) and gaps alternate until the persists add up to ``--window`` seconds
  (``window_s``: 1 in quick mode, 2 otherwise), so that both conditions see the same
  load from whatever else runs on a shared host; the median over repetitions. The
  same is measured, in the same repetitions,
  with other background activities as controls: the same persist through a staging
  copy made by a thread of the training process (``staged``: the writer's default, and
  what the runtime used before zero-copy), the same persist from a thread of the
  training process (``isolation="thread"``), a plain write of the same bytes, and a
  CPU-bound process (what any busy helper costs on this host); in full mode also a
  zero-copy persist paced with ``max_write_mbps``;
- ``s3_persist_s`` / ``s3_raw_write_s``: the same persist to S3 through s3fs against a
  moto server in its own process on 127.0.0.1, over one plain PUT (``pipe_file``) of
  the same bytes to the same server.

Old checkpoints are deleted between repetitions outside the timed regions (retention
is not part of ``persist_s``). Usage: ``python -m benchmarks.bench_persist [--quick]``;
progress goes to stderr and the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch

from benchmarks._harness import REPO, emit, median, progress
from replication.config import PersistenceConfig
from replication.durable import DurableWriter
from replication.snapshots.snapshot import SnapshotEngine
from replication.training_state.state import TrainingState

SPIN = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < {}: pass"
SETTLE_S = 0.02  # after a background run ends, before its idle gap is measured
WIDTH = 1024  # one Linear(WIDTH, WIDTH) layer: ~4.2 MB of weights, ~12.6 MB with Adam


def big_state(mb: int) -> tuple[TrainingState, SnapshotEngine]:
    layers = max(1, round(mb * 1e6 / (3 * 4 * (WIDTH * WIDTH + WIDTH))))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()  # Adam state exists from here on
    state = TrainingState()
    state.register("model", model)
    state.register("optim", opt)
    return state, SnapshotEngine(state, shared_memory=True, num_slots=3)


class SmallLoop:
    """A small CPU training loop whose steps/s is the throughput measure."""

    def __init__(self) -> None:
        torch.manual_seed(1)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
            torch.nn.ReLU(), torch.nn.Linear(256, 10),
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x, self.y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()

    def rate_for(self, seconds: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self.step()
            n += 1
        return n / (time.perf_counter() - t0)

    def cycles(self, start, seconds: float) -> tuple[float, float]:
        """(steps/s while ``start()``'s background activity runs, steps/s without it).

        ``start()`` launches one run of the activity and returns its ``done()``. Each
        run is followed by an idle gap as long as the run (after a short settling
        pause), until the runs add up to ``seconds``: the two conditions alternate
        every fraction of a second, so both see the same load from the rest of a
        shared host.
        """
        n_on = n_off = 0
        t_on = t_off = 0.0
        while t_on < seconds:
            done, t0 = start(), time.perf_counter()
            while not done():
                self.step()
                n_on += 1
            t1 = time.perf_counter()
            t_on += t1 - t0
            while time.perf_counter() - t1 < SETTLE_S:
                self.step()
            t2 = time.perf_counter()
            while time.perf_counter() - t2 < t1 - t0:
                self.step()
                n_off += 1
            t_off += time.perf_counter() - t2
        return n_on / t_on, n_off / t_off



def raw_write(buf: torch.Tensor, path: str) -> float:
    mv = memoryview(buf.numpy())
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(mv)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def torch_save_fsync(state: TrainingState, path: str) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state.capture(), f)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def clear_steps(root: str) -> None:
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.startswith("step_"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def persist_once(writer: DurableWriter, engine: SnapshotEngine, step: int):
    """Snapshot ``step`` and submit it: (ticket, seconds in submit, time of submit,
    snapshot bytes)."""
    slot = engine.capture(step)
    meta = engine.seal(slot)
    engine.protect(step)
    assert slot.buffer is not None
    t0 = time.perf_counter()
    ticket = writer.submit(meta, slot.buffer)
    return ticket, time.perf_counter() - t0, t0, slot.buffer[: meta.layout.nbytes]


def caller_cpu(writer: DurableWriter, engine: SnapshotEngine, step: int) -> float:
    """CPU seconds the calling process spends on one persist (all its threads, while
    this one only waits): the staging copy, for instance, but not the helper's work."""
    ticket, _block, _t0, _buf = persist_once(writer, engine, step)
    c0 = time.process_time()  # the capture above is the snapshot's cost, not the persist's
    assert ticket.result().status == "ok"
    return time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller state, fewer repetitions")
    ap.add_argument("--mb", type=int, default=None, help="state size in MB")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--dir", default=None, help="local directory to write to (default: tmp)")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) comparison")
    ap.add_argument("--window", type=float, default=None,
                    help="seconds per throughput window (default: 1 quick, 2 full)")
    ap.add_argument("--pace-mbps", type=float, default=300.0,
                    help="max_write_mbps of the paced writer (full mode only; default 300)")
    args = ap.parse_args()
    mb = args.mb or (128 if args.quick else 512)
    reps = args.reps or (4 if args.quick else 9)
    window = args.window or (1.0 if args.quick else 2.0)
    torch.set_num_threads(1)

    progress(f"building a training state of ~{mb} MB")
    state, engine = big_state(mb)
    loop = SmallLoop()
    work = tempfile.mkdtemp(prefix="bench_persist_", dir=args.dir)

    def new_writer(name: str, **kw) -> DurableWriter:
        cfg = PersistenceConfig(path=os.path.join(work, name), every_n_steps=1, keep_last=1000)
        return DurableWriter(cfg, 0, 1, run_id="bench", prune=False, progress_interval_s=0, **kw)

    writers = {"persist": new_writer("ckpt", zero_copy=True), "staged": new_writer("staged"),
               "thread": new_writer("thread", isolation="thread")}
    if not args.quick:
        writers["paced"] = new_writer("paced", zero_copy=True, max_write_mbps=args.pace_mbps)
    writer = writers["persist"]
    loop.rate_for(0.5)  # warm up (the helper processes start meanwhile)
    res: dict[str, list[float]] = {}

    def add(**kv: float) -> None:
        for k, v in kv.items():
            res.setdefault(k, []).append(v)

    state_bytes, step = 0, 0
    try:
        progress(f"{reps} interleaved repetitions: persist | plain write | torch.save "
                 "(writer otherwise idle)")
        for rep in range(reps + 1):  # repetition 0 warms up every path
            for w in writers.values() if rep == 0 else ():
                step += 1
                assert persist_once(w, engine, step)[0].result().status == "ok"
                clear_steps(w.config.path)
            step += 1
            ticket, block, t0, buf = persist_once(writer, engine, step)
            state_bytes = buf.numel()
            ticket.wait_released()
            release = time.perf_counter() - t0
            result = ticket.result()
            persist = time.perf_counter() - t0
            assert result.status == "ok", result
            clear_steps(writer.config.path)
            raw = raw_write(buf, os.path.join(work, "raw.bin"))
            save = torch_save_fsync(state, os.path.join(work, "save.pt"))
            step += 2
            caller = caller_cpu(writer, engine, step - 1)
            staged_caller = caller_cpu(writers["staged"], engine, step)
            clear_steps(writer.config.path)
            clear_steps(writers["staged"].config.path)
            if rep:
                add(block=block, release=release, persist=persist, raw=raw, save=save,
                    cpu=result.cpu_s, caller=caller, staged_caller=staged_caller)
                progress(f"rep {rep}/{reps}: submit {block * 1e3:.2f} ms, released "
                         f"{release * 1e3:.0f} ms, persist {persist:.2f}s (writer CPU "
                         f"{result.cpu_s:.2f}s, in this process {caller * 1e3:.0f} ms; "
                         f"staged: {staged_caller * 1e3:.0f} ms), plain write {raw:.2f}s, "
                         f"torch.save {save:.2f}s")
        kinds = [*writers, "raw", "spin"]
        progress(f"{reps} interleaved repetitions of training alone, then with each of: "
                 "a zero-copy persist (helper process) | a staged persist (helper process) | "
                 "a persist from a thread | "
                 + (f"a persist paced at {args.pace_mbps:.0f} MB/s | " if "paced" in kinds else "")
                 + "a plain write of the same bytes | a CPU-bound process")
        step += 1
        slot = engine.capture(step)  # persisted over and over, under new step numbers
        meta = engine.seal(slot)
        engine.protect(step)
        assert slot.buffer is not None
        for rep in range(reps):
            rates, ratios = [], {}
            for kind in kinds:
                if kind in writers:
                    w, tickets = writers[kind], []

                    def start(w=w, tickets=tickets):
                        nonlocal step
                        step += 1
                        tickets.append(w.submit(dataclasses.replace(meta, step=step),
                                                slot.buffer))
                        return tickets[-1].done.done

                    during, alone = loop.cycles(start, window)
                    results = [t.result() for t in tickets]
                    assert all(r.status == "ok" for r in results), results
                    clear_steps(w.config.path)
                    add(**{f"busy_{kind}": median([r.duration_s for r in results])})
                elif kind == "raw":
                    def start():
                        th = threading.Thread(target=raw_write, args=(buf, os.path.join(
                            work, "raw.bin")))
                        th.start()
                        return lambda: not th.is_alive()

                    during, alone = loop.cycles(start, window)
                else:
                    def start():
                        spin = subprocess.Popen([sys.executable, "-c", SPIN.format(0.3)])
                        return lambda: spin.poll() is not None

                    during, alone = loop.cycles(start, window)
                ratios[kind] = during / alone
                rates.append(alone)
                if kind == "persist":
                    add(base_rate=alone, during_rate=during)
            add(**{f"ratio_{k}": v for k, v in ratios.items()})
            progress(f"rep {rep + 1}/{reps}: throughput ratio: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
                     + f" (alone: {min(rates):.0f}-{max(rates):.0f} steps/s)")
    finally:
        for w in writers.values():
            w.close()
        shutil.rmtree(work, ignore_errors=True)

    m = {k: median(v) for k, v in res.items()}
    out = {
        "quick": args.quick,
        "state_bytes": state_bytes,
        "reps": reps,
        "window_s": window,
        "persist_block_s": m["block"],
        "release_s": m["release"],
        "torch_save_fsync_s": m["save"],
        "block_over_sync": m["block"] / m["save"],
        "persist_s": m["persist"],
        "persist_writer_cpu_s": m["cpu"],
        "persist_caller_cpu_s": m["caller"],
        "staged_persist_caller_cpu_s": m["staged_caller"],
        "raw_write_s": m["raw"],
        "persist_over_raw_write": m["persist"] / m["raw"],
        "persist_MBps": state_bytes / m["persist"] / 1e6,
        "raw_write_MBps": state_bytes / m["raw"] / 1e6,
        "throughput_during_persist_ratio": m["ratio_persist"],
        "steps_per_s_no_persist": m["base_rate"],
        "steps_per_s_during_persist": m["during_rate"],
        "persist_during_training_s": m["busy_persist"],
        "throughput_during_staged_persist_ratio": m["ratio_staged"],
        "staged_persist_during_training_s": m["busy_staged"],
        "throughput_during_thread_persist_ratio": m["ratio_thread"],
        "thread_persist_during_training_s": m["busy_thread"],
        "throughput_during_raw_write_ratio": m["ratio_raw"],
        "throughput_during_cpu_spin_ratio": m["ratio_spin"],
    }
    if "paced" in writers:
        out.update(
            paced_mbps=args.pace_mbps,
            throughput_during_paced_persist_ratio=m["ratio_paced"],
            paced_persist_during_training_s=m["busy_paced"],
        )
    if not args.no_s3:
        out.update(s3_figures(state, engine, reps=1 if args.quick else 2, first_step=step + 1))
    emit(out)


def s3_figures(state: TrainingState, engine: SnapshotEngine, reps: int,
               first_step: int) -> dict[str, float]:

    sys.path.insert(0, str(REPO))
    from tests.s3_server import moto_s3

    progress("starting a moto S3 server (own process) on 127.0.0.1")
    persists, raws = [], []
    with moto_s3(subprocess=True) as s3:
        fs = s3.filesystem()
        cfg = PersistenceConfig(path=s3.url("bench"), every_n_steps=1, keep_last=1000,
                                storage_options=s3.storage_options)
        writer = DurableWriter(cfg, 0, 1, run_id="bench", prune=False, progress_interval_s=0,
                               zero_copy=True)
        try:
            for rep in range(reps + 1):
                step = first_step + rep
                slot = engine.capture(step)
                meta = engine.seal(slot)
                engine.protect(step)
                assert slot.buffer is not None
                t0 = time.perf_counter()
                result = writer.submit(meta, slot.buffer).result()
                persist = time.perf_counter() - t0
                assert result.status == "ok", result
                fs.rm(s3.url("bench", f"step_{step}"), recursive=True)
                data = slot.buffer[: meta.layout.nbytes].numpy().tobytes()
                t0 = time.perf_counter()
                fs.pipe_file(s3.url("raw.bin"), data)
                raw = time.perf_counter() - t0
                fs.rm(s3.url("raw.bin"))
                del data
                if rep == 0:
                    continue
                persists.append(persist)
                raws.append(raw)
                progress(f"s3 rep {rep}/{reps}: persist {persist:.2f}s, plain PUT {raw:.2f}s")
        finally:
            writer.close()
    return {
        "s3_persist_s": median(persists),
        "s3_raw_write_s": median(raws),
        "s3_persist_over_raw_write": median(persists) / median(raws),
    }


if __name__ == "__main__":
    main()
