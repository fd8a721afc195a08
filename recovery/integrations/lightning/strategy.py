"""``Trainer(strategy="checkpointless")``: DDP that survives rank and node failures in-process.

The strategy drives the worker runtime (:class:`recovery.runtime.checkpointless.Checkpointless`)
from
inside Lightning's own loop; the script changes nothing but the strategy name:

- **Process groups.** The runtime creates the job's process group (its own backend,
  :mod:`recovery.process_group.owned_group`, instead of ``init_process_group("env://")``). It lives
  across generations: after a failure only its inner gloo group is swapped, and DDP is
  re-wrapped on it when ``fit`` is re-entered.
- **Step boundary.** The training loader is wrapped (``process_dataloader``) so that the
  moment before each training batch is fetched is observable: the previous optimizer
  step, validation, scheduler steps and loop bookkeeping are all done, and nothing of the
  next step has happened. A snapshot is taken there (a Lightning checkpoint dictionary
  plus RNG streams, see :mod:`.state`), except after validation or at an epoch's first
  batch, where Lightning's resume would not replay the same hooks.
- **Failure.** Every collective in flight on that group ends with an error the moment a
  failure is declared, whoever issued it: DDP's gradient all-reduce in ``backward``,
  Lightning's per-batch stop-flag broadcast, its barriers and metric syncs. So the
  strategy keeps DDPStrategy's own collectives and comm hooks unchanged. The exception
  reaches the strategy's launcher (:mod:`.launcher`), which tears the attempt down (the
  model and optimizer state stay on their device: Lightning's own teardown would copy
  them to the host and back), lets the runtime recover, and re-enters ``fit`` from the
  restored state.
- **Durable tier.** ``ModelCheckpoint`` and ``trainer.save_checkpoint`` go through
  :class:`~.checkpoint_io.CheckpointlessCheckpointIO` (async, every rank, any fsspec URL);
  ``ckpt_path`` may name such a checkpoint, a ``persistence.path`` root, or
  ``"checkpointless://latest"``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping, Sequence
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel

from recovery.common.env import WorkerEnv
from recovery.generation import protocol, world
from recovery.integrations.lightning import loop_state, replayed_saves
from recovery.integrations.lightning.checkpoint_io import (
    LATEST,
    MEMORY,
    CheckpointlessCheckpointIO,
    is_durable,
    load_durable,
    newest_durable,
)
from recovery.integrations.lightning.data import ResumableLoader
from recovery.integrations.lightning.launcher import CheckpointlessLauncher
from recovery.integrations.lightning.logger_gate import LoggerGate
from recovery.integrations.lightning.state import (
    MODES_KEY,
    PARTS_DATA_PARALLEL,
    LightningState,
    ModelBuffers,
)
from recovery.loader import hosted_loader
from recovery.process_group import ddp_layout, device_placement
from recovery.recipe import CheckpointlessConfig, load_config, worker_config
from recovery.resize import world_resize
from recovery.runtime import live_rollback
from replication import contract

log = logging.getLogger("checkpointless.lightning")

_DEFERRED_RNG = ("fetch", "train_start", "end")


class CheckpointlessStrategy(DDPStrategy):
    """DDP with in-process recovery; see the module docstring.

    Args:
        recipe: a YAML recipe (its ``checkpointless:`` block) used when the script runs
            without ``checkpointless run``; under the launcher the job's configuration
            (``--recipe``, overrides) applies.
        overrides: ``key=value`` settings on top of ``recipe``.
        settings: ready-made runtime settings instead of a recipe.
        checkpoint_io: defaults to :class:`CheckpointlessCheckpointIO` (the durable tier).
        deterministic: kept for scripts written for earlier versions: a recovered run is
            bit-identical either way, since DDP's bucket layout is carried with the
            state (ADR 0034). ``False`` also turns ``recovery.ordered_allreduce`` off
            where a recipe turned it on.
        **kwargs: everything :class:`~lightning.pytorch.strategies.DDPStrategy` takes
            (``find_unused_parameters``, ``ddp_comm_hook``, ``timeout``, ...).
    """

    strategy_name = "checkpointless"

    def __init__(
        self,
        recipe: str | os.PathLike | None = None,
        overrides: Sequence[str] = (),
        settings: CheckpointlessConfig | None = None,
        checkpoint_io: Any = None,
        deterministic: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(checkpoint_io=checkpoint_io or CheckpointlessCheckpointIO(), **kwargs)
        if isinstance(overrides, str):
            overrides = [overrides]
        self._recipe, self._overrides = recipe, tuple(overrides)
        self._given_settings = settings
        self._settings: CheckpointlessConfig | None = None
        self.deterministic = deterministic
        if contract.ENV_CONFIG not in os.environ and settings is None and (recipe or overrides):
            self._given_settings = load_config(recipe, self._overrides)  # fail early
        self.lstate = LightningState()
        #: recovery.runtime.checkpointless.Checkpointless, once the job is joined
        self.session: Any = None
        self.finished = False
        self.abandoning = False
        self._started = False
        self._restored = False
        self._from_memory = False
        self._initial_done = False
        self._loaded_loops: Any = None
        self._snap_step = -1
        self._step_at_fetch: int | None = None
        self._loaders: list[ResumableLoader] = []
        # why the job cannot change size, as its training loaders last said (ADR 0035)
        self._loader_refusal: str | None = "its training loader is not known yet"
        self._observed: dict[str, Any] | None = None  # restored loop state, until fit starts
        self._warned_epoch_boundary = False
        self._snap_due_next = False
        self.gate = LoggerGate(lambda: self.session.step if self.session is not None else 0)

    # -- configuration -----------------------------------------------------------------
    @property
    def settings(self) -> CheckpointlessConfig:
        """The launcher's configuration under ``checkpointless run``, else the strategy's."""
        if self._settings is None:
            env_json = os.environ.get(contract.ENV_CONFIG)
            if env_json:
                if self._recipe or self._overrides or self._given_settings is not None:
                    log.warning("running under checkpointless run: the job's configuration "
                                "applies, not the strategy's recipe/overrides/settings")
                self._settings = worker_config(env_json)
            else:
                self._settings = self._given_settings or CheckpointlessConfig()
            if not self.deterministic:
                self._settings.recovery.ordered_allreduce = False
        return self._settings

    def _setup_model(self, model: Any) -> Any:
        """Lightning's DDP, over the bucket layout of the restored step after a recovery
        (each ``fit`` attempt wraps the module in a new DDP; see
        :mod:`recovery.process_group.ddp_layout`)."""
        ddp = super()._setup_model(model)
        if self.session is not None:
            ddp_layout.track(self.session.state).adopt(ddp)
        return ddp

    def _configure_launcher(self) -> None:
        self._launcher = CheckpointlessLauncher(self)

    # -- joining the job ---------------------------------------------------------------
    def join_job(self) -> Any:
        """Connect to the job and take this rank's place in the current generation.

        A replacement (or any process started after a failure) receives the state of
        the newest committed step here, before Lightning builds anything.
        """
        from recovery.runtime.checkpointless import Checkpointless

        if self.session is None:
            env = WorkerEnv.from_environ()
            resized = int(os.environ.get(world.ENV_CONFIGURED_WORLD) or env.world_size)
            if resized != env.world_size and env.world_size % self.num_processes == 0:
                # The job shrank or grew (ADR 0035): whole nodes went, so the Trainer's
                # devices still hold and its node count is the world's.
                self.num_nodes = env.world_size // self.num_processes
            self.set_world_ranks()
            if (env.world_size, env.rank) != (self.world_size, self.global_rank):
                from lightning.fabric.utilities.exceptions import MisconfigurationException

                raise MisconfigurationException(
                    f"strategy='checkpointless': the Trainer describes rank {self.global_rank} "
                    f"of {self.world_size} (devices x num_nodes), but this process is rank "
                    f"{env.rank} of {env.world_size} (RANK/WORLD_SIZE). Start one process per "
                    "device with `checkpointless run` and set Trainer(devices=, num_nodes=) "
                    "to match --nproc-per-node and --nnodes")
            if self.accelerator is not None:
                # Lightning selects the device in ``setup_environment``, after the launcher
                # has run; joining first would let the runtime's group, a replacement's
                # pinned receive buffers and its RNG restore use CUDA's current device,
                # cuda:0 on every local rank (a context each on GPU 0, NCCL on the wrong
                # card). Lightning itself selects the device before its group exists.
                self.accelerator.setup_device(self.root_device)
                if self.root_device.type == "cuda":  # the runtime keeps Lightning's choice
                    device_placement.chosen(self.root_device.index or 0)
            self.session = Checkpointless(
                settings=self.settings, backend=self._get_process_group_backend(), env=env,
                state=self.lstate.registry, start=False,
            )
            if self.session.live_rollback:
                # The registered state is checkpoint parts rebuilt at each snapshot, not
                # live objects: marks are taken at snapshots, and a failure goes on from
                # the newest one even before its round commits (ADR 0039, addendum 2).
                self.session.live_rollback = live_rollback.SnapshotMarks(
                    large=PARTS_DATA_PARALLEL,
                    buffers=ModelBuffers(self.lstate, lambda: self.lightning_module))
            if self.lightning_module is not None:
                self.session.faults.install(self.lightning_module, None)
            # Lightning's job can change size when its training loaders split by rank
            self.session.resize_refusal = self._resize_refusal
        if not self._started:
            self._started = True
            self.session.start(initial_snapshot=False)
            self._restored = self.session.restored_step is not None
            if self._restored:
                self._snap_step = int(self.session.restored_step)
            if isinstance(self.checkpoint_io, CheckpointlessCheckpointIO):
                self.checkpoint_io.set_world(self.global_rank, self.world_size,
                                             run_id=self.session.env.job_id)
        return self.session

    @property
    def has_restored_state(self) -> bool:
        return self._restored and self.lstate.has_pending

    def pin_logger_versions(self, trainer: Any) -> None:
        """Before Lightning resolves a log directory: a replacement's loggers continue
        the versions (directories) of the run whose state it received."""
        if self.global_rank != 0 or not trainer.loggers:
            return
        observed = self.lstate.pending.get("trainer", {}).get(loop_state.KEY)
        if observed:
            LoggerGate.pin_versions(trainer.loggers, observed.get("logged"))

    @property
    def memory_ckpt_path(self) -> str:
        return MEMORY

    def recover(self, exc: BaseException) -> int:
        """Recover from a failed ``fit`` attempt; the restored state waits for Lightning."""
        self._restored = False
        step = self.session.recover(exc)
        self._restored = True
        self._snap_step = step
        self._step_at_fetch = None
        return step

    def _get_process_group_backend(self) -> str:
        """The inner backends of the runtime's group, per device
        (:mod:`recovery.process_group.init_hook`).

        ``process_group_backend="gloo"`` on GPUs: the runtime reads a bare ``"gloo"`` as
        CPU tensors only, so DDP's all-reduce of CUDA gradients would find no backend in
        every generation and each step would fail into a recovery. torch's own gloo group
        takes CUDA tensors; so does a gloo inner backend for the ``cuda`` device.
        """
        backend = super()._get_process_group_backend()
        if backend == "gloo" and self.root_device.type == "cuda":
            return "cpu:gloo,cuda:gloo"
        return backend

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        self.join_job()
        if not dist.is_initialized():  # pragma: no cover - join_job builds it
            raise RuntimeError("checkpointless: no training process group after joining")

    # -- DDP -----------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.session is not None and self.session.faults:
            for optimizer in self.optimizers:  # new objects on every (re-)entry of fit
                self.session.faults.install(None, optimizer)
        if trainer.state.fn == "fit" and self.session is not None:
            replayed_saves.install(trainer, self.session.store)
        if trainer.state.fn == "fit" and self.global_rank == 0 and trainer.loggers:
            self.gate.install(trainer.loggers)
            if self.session is not None:
                store = self.session.store
                self.gate.use_store(lambda: protocol.logged_through(store),
                                    lambda step: protocol.mark_logged(store, step))

    def teardown(self) -> None:
        io = self.checkpoint_io
        if self.abandoning:
            self._loaders.clear()
            if isinstance(io, CheckpointlessCheckpointIO):
                io.flush_on_teardown = False  # never wait for storage on the recovery path
        try:
            if self.abandoning:
                self._release_attempt()
            else:
                super().teardown()
        finally:
            if isinstance(io, CheckpointlessCheckpointIO):
                io.flush_on_teardown = True

    def _release_attempt(self) -> None:
        """``DDPStrategy.teardown`` for a failed attempt, minus its moves to the CPU.

        Lightning's teardown moves the model and the optimizer state to the CPU, which the
        next ``fit`` attempt's ``model_to_device`` moves back: on a GPU, two passes of the
        whole state over PCIe in every recovery (seconds for a large model), for state the
        restore overwrites anyway. Here the model stays where it is and is unwrapped from
        the failed attempt's DDP (re-wrapped by the next attempt, over the new generation's
        group), its layer sync is reverted as Lightning does, and the device memory that
        the move would have freed is freed without a copy: the interrupted step's
        gradients and the failed attempt's optimizer state, both replaced by the restored
        snapshot (the next attempt builds new optimizers and loads their state into them;
        the runtime still names the old ones until its next snapshot, so dropping only
        the references would keep that state on the device through the restore). The
        precision plugin, accelerator (on CUDA: collect and empty the allocator's cache,
        before the next generation's NCCL communicator allocates) and checkpoint IO are
        torn down as Lightning does.
        """
        module = self.lightning_module
        if isinstance(self.model, DistributedDataParallel):
            self.model = module
        trainer = module._trainer if module is not None else None
        if (self._layer_sync and trainer is not None and self.model is not None
                and trainer.state.fn == TrainerFn.FITTING):
            self.model = self._layer_sync.revert(self.model)
        for optimizer in self.optimizers:
            state = getattr(optimizer, "state", None)
            if isinstance(state, MutableMapping):
                state.clear()
        if module is not None:
            module.zero_grad(set_to_none=True)
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        if self.global_rank == 0 and self.session is not None and (
                self.lightning_module is not None):
            replayed_saves.record(self.session.store, filepath,
                                  self.lightning_module.trainer.global_step)
        if isinstance(self.checkpoint_io, CheckpointlessCheckpointIO):
            # Every rank saves its own part: per-rank RNG streams and data positions.
            self.checkpoint_io.save_checkpoint(checkpoint, filepath,
                                               storage_options=storage_options)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        path = str(checkpoint_path)
        if path == MEMORY:
            self._restored, self._from_memory = False, True
            checkpoint = self.lstate.take_checkpoint()
            self._restore_modes(checkpoint)
            self._observed = checkpoint.pop(loop_state.KEY, None)
            return checkpoint
        self._from_memory = False
        opts = getattr(self.checkpoint_io, "storage_options", None) or {}
        if path == LATEST:
            path = self._latest_durable(opts)
        if is_durable(path, opts):
            checkpoint, state = load_durable(path, self.global_rank, self.world_size, opts)
            checkpoint.pop("__checkpointless_rng__", None)
            self._observed = checkpoint.pop(loop_state.KEY, None)
            pending = state.rng.pending
            if pending is not None and pending.get("at") in _DEFERRED_RNG:
                self.lstate.rng.pending = pending  # a persisted snapshot: exact resume
            else:
                state.rng.apply_now()
        else:
            from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

            io = self.checkpoint_io
            if isinstance(io, CheckpointlessCheckpointIO):
                io = TorchCheckpointIO()  # a plain Lightning checkpoint file
            kwargs = {"weights_only": weights_only} if weights_only is not None else {}
            checkpoint = io.load_checkpoint(path, **kwargs)
        self._restore_modes(checkpoint)
        self._loaded_loops = checkpoint.get("loops")
        return checkpoint

    def _latest_durable(self, opts: dict) -> str:
        roots = []
        persist = self.settings.persistence.path
        if persist:
            roots.append(persist)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        for cb in getattr(trainer, "checkpoint_callbacks", []) or []:
            dirpath = getattr(cb, "dirpath", None)
            if dirpath:
                roots.append(str(dirpath))
        found = newest_durable(roots, opts)
        if found is None:
            raise FileNotFoundError(
                f"ckpt_path={LATEST!r}: no valid durable checkpoint under "
                f"{roots or 'persistence.path or a ModelCheckpoint dirpath (neither is set)'}")
        return found

    # -- data and the step boundary --------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if (trainer is None or not trainer.training or trainer.sanity_checking
                or isinstance(dataloader, ResumableLoader)):
            return dataloader
        wrapped = ResumableLoader(dataloader, self)
        session = self.session
        if session is not None and session.world.resized:  # the ranks whose data it takes
            wrapped.host(session.world.hosted(session.rank), session.configured)
        self._loaders.append(wrapped)
        self._loader_refusal = next((why for loader in self._loaders if (
            why := hosted_loader.refusal(loader.inner)) is not None), None)
        if session is not None:
            world_resize.publish_resizability(session)  # now that the loader is known
        return wrapped

    def _resize_refusal(self) -> str | None:
        """Why this job cannot change size (ADR 0035), or None: Lightning's DDP is data
        parallel, so it is the training loaders that decide (as last seen: a failed
        attempt's teardown drops them before the recovery asks)."""
        return self._loader_refusal

    def current_epoch(self) -> int:
        return self.lightning_module.trainer.current_epoch

    def after_iterator_created(self) -> None:
        self.lstate.rng.apply_pending("fetch")

    def before_fetch(self, first: bool) -> None:
        """The step boundary: called before every training batch is fetched."""
        session = self.session
        trainer = self.lightning_module.trainer
        if session is None or trainer.sanity_checking or not trainer.training:
            return
        g = trainer.global_step
        stepped = self._step_at_fetch is not None and g != self._step_at_fetch
        self._step_at_fetch = g
        if stepped:
            every = session.settings.replication.every_n_steps
            persist = session.settings.persistence
            persist_every = persist.every_n_steps if persist.path else 0
            on_cadence = g % every == 0 or (persist_every > 0 and g % persist_every == 0)
            due = g > self._snap_step and (on_cadence or self._snap_due_next)
            if due and first:  # taken at the next boundary instead
                self._warn_epoch_boundary(g, every)
            self._snap_due_next = due and first
            self._end_step(trainer, g, due and not first, "fetch")
        session.begin_step(g + 1)

    def _warn_epoch_boundary(self, step: int, every: int) -> None:
        """A snapshot due at an epoch's last step is taken one step later: resuming
        at an epoch's first batch would run ``on_train_epoch_start`` hooks twice. A
        durable save due there moves with it (:mod:`recovery.schedules.save_schedule`)."""
        if not self._warned_epoch_boundary and self.global_rank == 0:
            self._warned_epoch_boundary = True
            log.warning(
                "checkpointless: step %d ends an epoch; its snapshot (and a durable save due "
                "there) is taken at step %d instead, since a resume at an epoch's first "
                "batch would run on_train_epoch_start twice (replication.every_n_steps=%d; "
                "the same at every epoch end; shown once)", step, step + 1, every)

    def _end_step(self, trainer: Any, step: int, snapshot: bool, at: str) -> None:
        if snapshot and self.gate.holding:
            # Rows of steps up to the previous snapshot are committed once its round
            # is: write them now; the rows still held travel in this snapshot.
            self.session.wait_committed()
            self.gate.release(self._snap_step)
        if snapshot:
            self.lstate.refresh(lambda: self._dump(trainer), at=at,
                                optimizers=trainer.optimizers)
        try:
            self.session.end_step(step, snapshot=snapshot)
        finally:
            self.lstate.release()
        if snapshot:
            self._snap_step = step
            for loader in self._loaders:
                mark = getattr(loader.inner, "mark_committed", None)
                if callable(mark):
                    mark()

    @staticmethod
    def _dump(trainer: Any) -> dict[str, Any]:
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        # Train/eval mode is not state_dict state, and Lightning (2.5+) no longer sets
        # train mode when fit starts: a failure inside validation would otherwise replay
        # the next steps in eval mode (no dropout).
        checkpoint[MODES_KEY] = [m.training for m in trainer.lightning_module.modules()]
        strategy = trainer.strategy
        checkpoint[loop_state.KEY] = {**loop_state.capture(trainer),
                                      "logged": strategy.gate.snapshot()}
        return checkpoint

    def _restore_modes(self, checkpoint: dict[str, Any]) -> None:
        modes = checkpoint.pop(MODES_KEY, None)
        modules = list(self.lightning_module.modules()) if self.lightning_module else []
        if isinstance(modes, list) and len(modes) == len(modules):
            for module, training in zip(modules, modes):
                module.training = bool(training)

    # -- hooks -------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        self._step_at_fetch = trainer.global_step
        if self._observed is not None:  # resumed from one of the runtime's snapshots
            observed, self._observed = self._observed, None
            loop_state.restore(trainer, observed)
            self.gate.restore(observed["logged"], target=trainer.global_step)
            _resume_at_boundary(trainer.fit_loop.epoch_loop)
        if self._from_memory:  # re-entered fit from the runtime's restored state
            self._from_memory = False
            self.lstate.rng.apply_pending("train_start")
        elif not self._initial_done:
            self._commit_initial(trainer)
        self._initial_done = True

    def _commit_initial(self, trainer: Any) -> None:
        """The state training starts from is committed before the first step runs."""
        step = trainer.global_step
        loaded = self._loaded_loops

        def dump() -> dict[str, Any]:
            checkpoint = self._dump(trainer)
            if loaded is not None:  # resumed from ckpt_path: resume that way again
                checkpoint["loops"] = loaded
            return checkpoint

        self.lstate.refresh(dump, at="train_start", optimizers=trainer.optimizers)
        try:
            self.session.commit_initial(step)
        finally:
            self.lstate.release()
        self._snap_step = step

    def on_train_end(self) -> None:
        super().on_train_end()
        trainer = self.lightning_module.trainer
        step = trainer.global_step
        if self.session is not None and step > self._snap_step:
            self._end_step(trainer, step, True, "end")  # the final state, committed
        if self.session is not None:
            self.session.wait_committed()
            self.gate.finish()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        from recovery.integrations.lightning.registration import NAMES

        for name, description in NAMES.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description)


def _resume_at_boundary(epoch_loop: Any) -> None:
    """Resume a snapshot taken at the step boundary as exactly that point.

    Lightning's restart logic assumes a checkpoint written inside a batch's
    ``on_advance_end`` (``ModelCheckpoint`` on validation end): when validation was due
    after the restored batch, its first ``advance`` skips the batch and re-runs the tail
    of ``on_advance_end`` (the plateau schedulers step again, the logger step advances
    again). The runtime's snapshots are taken after that tail, before the next batch is
    fetched, so for them the first restart check answers "no validation pending".
    """
    cls_check = type(epoch_loop)._should_check_val_fx

    def first_check(data_fetcher: Any) -> bool:
        del epoch_loop._should_check_val_fx
        if epoch_loop.restarting:
            return False
        return cls_check(epoch_loop, data_fetcher)

    epoch_loop._should_check_val_fx = first_check
