"""The training job of ``bench_goodput``: one small GPT, two ways of surviving failures.

- ``--mode checkpointless``: under ``checkpointless run``; faults come from the
  runtime's own hook (``recovery.fault=...`` on the launcher's command line) and every
  recovery happens in-process.
- ``--mode dcp``: under plain ``torchrun --max-restarts``; a synchronous DCP checkpoint
  every ``--ckpt-every`` steps and, on every (re)start, a resume from the newest one.
  Faults come from ``--faults`` in the same ``rank:step:phase[:kind]`` syntax and fire
  once per job (an ``O_EXCL`` marker file decides, as the store counter does for the
  runtime).

The model, the data, the step and the gradient averaging are the same code in both
modes, so a failure-free run ends with the same digests in both.

Both modes write ``final_rank<r>.json`` (model+optimizer digest, step, data order and
position) at the end. The DCP mode also appends its timeline (starts, resumes, steps,
saves, faults) to ``<out>/progress.jsonl``; the checkpointless mode's timeline is the
run's ``events.jsonl``.

How the baseline plays each fault kind (the mapping is deliberately generous to it):

- ``sigkill``/``exception``: the rank dies or raises; torchrun restarts every rank.
- ``sigstop`` (a hang): the rank blocks forever but stays killable by SIGTERM (a
  SIGSTOPped process would cost torchrun its 30 s SIGTERM grace on top); the other
  ranks notice when their collective times out (``--pg-timeout-s``, set to the
  runtime's heartbeat timeout), exit, and torchrun restarts the job.
- ``node``: the rank kills torchrun and every worker (a lost machine); the benchmark,
  acting as the scheduler, starts torchrun again at once.
- phase ``recovery``: fires while the rank restarts after the fault at that step.
- phases ``snapshot``/``replication`` (the runtime's own) fire at the end of the step.
- a DCP save that fails (storage outage) is logged and training goes on, where a
  plain script would crash.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

try:
    from examples.gpt import CharData, TinyGPT, loss_fn, lr_lambda, make_corpus, state_digest
except ImportError:  # pragma: no cover - run with the repository on PYTHONPATH
    raise SystemExit("goodput_worker: run with the repository root on PYTHONPATH") from None

from recovery.common.events import Event
from recovery.faults.spec import FaultSpec, parse_faults

#: Where a restarted baseline waits for storage to come back before it gives up.
STORAGE_WAIT_S = 60.0


class Job:
    """Model, optimizer, schedule and data of one rank, built the same way in both modes."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        torch.manual_seed(args.seed)  # same init on every rank (data parallel)
        self.data = CharData(make_corpus(), args.seq_len, args.batch, rank, world, seed=args.seed)
        self.model = TinyGPT(self.data.vocab_size, args.dim, args.layers, seq_len=args.seq_len)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(10, args.steps))
        torch.manual_seed(args.seed + 1000 + rank)  # per-rank dropout streams
        self.rank = rank

    def step(self, reduce) -> None:
        x, y = self.data.next_batch()
        loss_fn(self.model(x), y).backward()
        reduce(self.model)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()

    def final(self, step: int) -> dict:
        return {"rank": self.rank, "step": step, "digest": state_digest(self.model, self.opt),
                "data_order": self.data.order_hash, "position": self.data.position}


def write_final(out: Path, record: dict) -> None:
    path = out / f"final_rank{record['rank']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


# --- checkpointless ----------------------------------------------------------------------
def run_checkpointless(args: argparse.Namespace, out: Path) -> None:
    from recovery import Checkpointless

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job = Job(args, rank, world)
    cl = Checkpointless(model=job.model, optimizer=job.opt, scheduler=job.sched,
                        loader=job.data)
    cl.run(lambda step: job.step(cl.all_reduce_gradients), args.steps)
    write_final(out, job.final(cl.step))


# --- torchrun + DCP baseline -------------------------------------------------------------
class Timeline:
    """Appends one JSON line per event to ``progress.jsonl`` (one ``write``, ``O_APPEND``)."""

    def __init__(self, out: Path, rank: int) -> None:
        self.path, self.rank = out / "progress.jsonl", rank

    def emit(self, event: str, **fields) -> None:
        line = json.dumps({"ts": time.time(), "event": event, "rank": self.rank, **fields})
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


class FileFaults:
    """The baseline's fault injector: the runtime's semantics without a store."""

    def __init__(self, specs: list[FaultSpec], rank: int, fired_dir: Path, log: Timeline):
        self.specs = [s for s in specs if s.rank == rank]
        self.dir, self.log = fired_dir, log
        self.dir.mkdir(parents=True, exist_ok=True)
        self.step = 0

    def _marker(self, spec: FaultSpec) -> Path:
        return self.dir / str(spec).replace(":", "_")

    def _claim(self, spec: FaultSpec) -> bool:
        try:
            fd = os.open(self._marker(spec), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.write(fd, str(spec.step).encode())
        os.close(fd)
        return True

    def fired_steps(self) -> set[int]:
        return {int(p.read_text() or -1) for p in self.dir.iterdir()}

    def at(self, phase: str) -> None:
        for spec in self.specs:
            if spec.phase == phase and spec.step == self.step and self._claim(spec):
                self._fire(spec)

    def at_restart(self) -> None:
        """Phase ``recovery``: fire while restarting after the fault at the same step."""
        fired = self.fired_steps()
        for spec in self.specs:
            if spec.phase == "recovery" and spec.step in fired and self._claim(spec):
                self._fire(spec)

    def _fire(self, spec: FaultSpec) -> None:
        self.log.emit(Event.FAULT_INJECTED, fault=str(spec), step=spec.step, phase=spec.phase,
                      kind=spec.kind)
        if spec.kind == "exception":
            raise RuntimeError(f"injected exception on rank {spec.rank} at step {spec.step}")
        if spec.kind == "sigstop":
            threading.Event().wait()  # hung, but SIGTERM still ends it
        if spec.kind == "node":
            import psutil

            agent = psutil.Process(os.getppid())
            for p in [*agent.children(), agent]:
                if p.pid != os.getpid():
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
        os.kill(os.getpid(), signal.SIGKILL)

    def install(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        phases = {s.phase for s in self.specs}
        if "forward" in phases:
            model.register_forward_pre_hook(lambda *_: self.at("forward"))
        if "backward" in phases:
            first = next(p for p in model.parameters() if p.requires_grad)
            first.register_hook(lambda g: (self.at("backward"), g)[1])
        if "optimizer" in phases:
            opt.register_step_pre_hook(lambda *_: self.at("optimizer"))


def _state(job: Job, rank: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(job.model, job.opt)
    # Per-rank entries get per-rank keys: DCP deduplicates equal keys across ranks.
    return {"model": msd, "optim": osd, "sched": job.sched.state_dict(),
            f"rank{rank}": {"rng": torch.get_rng_state(), "data": job.data.state_dict()}}


def _newest_checkpoint(root: Path) -> tuple[int, Path] | None:
    deadline = time.monotonic() + STORAGE_WAIT_S
    while root.exists() and not root.is_dir():  # storage outage: wait for it to end
        if time.monotonic() > deadline:
            raise SystemExit(f"checkpoint storage {root} unavailable for {STORAGE_WAIT_S}s")
        time.sleep(0.1)
    if not root.is_dir():
        return None
    done = [(int(p.name.split("_")[1]), p) for p in root.glob("step_*")
            if (p / ".metadata").exists()]
    return max(done) if done else None


def _incarnation_store(timeout: timedelta) -> dist.Store:
    """torchrun's store, under a prefix of its own for this incarnation of the job.

    A restarted torchrun job reuses the same store, where the previous incarnation's
    gloo addresses are still published under the same keys: a new rank may read a dead
    peer's address before the peer overwrote it and fail to connect (seen on every
    restart here). Namespacing by ``TORCHELASTIC_RESTART_COUNT`` is the careful user's
    fix; the baseline gets it.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(host, port, world, is_master=not agent_hosts and rank == 0,
                          timeout=timeout, multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"goodput_worker/attempt_{attempt}", store)


def run_dcp(args: argparse.Namespace, out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    # Start-up and resume run on a group with a long timeout (ranks start at different
    # speeds); training and saves on one whose short timeout is how a hang is noticed.
    slow = timedelta(seconds=max(60.0, args.pg_timeout_s))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=_incarnation_store(slow), rank=rank,
                            world_size=world, timeout=slow)
    train_group = dist.new_group(timeout=timedelta(seconds=args.pg_timeout_s))
    log = Timeline(out, rank)
    log.emit(Event.START, pid=os.getpid(), restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                                 "0")))
    job = Job(args, rank, world)
    faults = FileFaults(parse_faults(args.faults), rank, out / "fired", log)
    faults.install(job.model, job.opt)
    root = Path(args.ckpt_dir)
    start = 1
    newest = _newest_checkpoint(root)
    if newest is not None:
        t0 = time.time()
        step0, path = newest
        sd = _state(job, rank)
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(job.model, job.opt, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        job.sched.load_state_dict(sd["sched"])
        torch.set_rng_state(sd[f"rank{rank}"]["rng"])
        job.data.load_state_dict(sd[f"rank{rank}"]["data"])
        start = step0 + 1
        log.emit(Event.RESUMED, step=step0, load_s=time.time() - t0)
    faults.at_restart()
    dist.barrier()  # every rank is ready: from here on, a silent peer is a hung one

    def reduce(model: torch.nn.Module) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=train_group)
        flat.div_(world)
        for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(f)

    for step in range(start, args.steps + 1):
        faults.step = step
        faults.at("step")
        job.step(reduce)
        faults.at("snapshot")
        faults.at("replication")
        if rank == 0:
            log.emit(Event.STEP, step=step)
        if step % args.ckpt_every == 0 or step == args.steps:
            t0 = time.time()
            try:
                dcp.save(_state(job, rank), checkpoint_id=str(root / f"step_{step}"),
                         process_group=train_group)
                log.emit(Event.SAVED, step=step, save_s=time.time() - t0)
            except Exception as exc:  # generous: a plain script would die here
                # A peer gone or hung reaches DCP's collectives as gloo's plain
                # RuntimeError ("Connection closed by peer", "Timed out waiting ..."),
                # the type a storage failure can have too: only the message tells.
                if "timed out" in str(exc).lower() or "connection" in str(exc).lower():
                    raise  # a peer is gone or hung, not the storage
                log.emit(Event.SAVE_FAILED, step=step, error=f"{type(exc).__name__}: {exc}"[:300])
    write_final(out, job.final(args.steps))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["checkpointless", "dcp"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", default="", help="dcp mode: rank:step:phase[:kind];...")
    ap.add_argument("--ckpt-dir", default="", help="dcp mode: checkpoint root")
    ap.add_argument("--ckpt-every", type=int, default=20, help="dcp mode: save every N steps")
    ap.add_argument("--pg-timeout-s", type=float, default=3.0,
                    help="dcp mode: collective timeout (how a hang is noticed)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.mode == "dcp" and not args.ckpt_dir:
        ap.error("--ckpt-dir is required with --mode dcp")
    (run_checkpointless if args.mode == "checkpointless" else run_dcp)(args, out)


if __name__ == "__main__":
    main()
