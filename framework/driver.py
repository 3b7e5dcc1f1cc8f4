"""The RL loop: rollout -> reward -> recompute logp -> compare bitwise -> train -> sync weights.

Every phase is timed (perf/*); the consistency report of a step is logged before training, and in
strict mode any mismatch stops the run there.
"""
from __future__ import annotations

import logging
import re
import time
from contextlib import contextmanager
from pathlib import Path

import ray
import torch
from omegaconf import DictConfig, OmegaConf

from lockstep.framework import resume, settings
from lockstep.framework.consistency.compare import check_importance_ratio, compare_logp, raise_on_mismatch
from lockstep.framework.consistency.record import write_record
from lockstep.framework.data.dataset import PromptSampler, load_records
from lockstep.framework.data.rewards import get_reward_fn
from lockstep.framework.data.tokenizer import tokenizer_for
from lockstep.framework.placement import Resources, placed
from lockstep.framework.rollout.base import SamplingParams
from lockstep.framework.rollout.sampling import sample_seed
from lockstep.framework.summary import RunSummary
from lockstep.framework.tracking.tracker import METRICS_FILE, Tracker
from lockstep.framework.weights.sync import sync_weights
from lockstep.framework.workers import actor_world_size, engine_ranks, spawn_actor, spawn_rollouts

RESOLVED_CONFIG = "config.yaml"
log = logging.getLogger("lockstep")


class WorkerDied(RuntimeError):
    """A Ray worker process (actor rank or engine) died: which one, when, and Ray's account of it."""


def worker_died(e: "ray.exceptions.RayActorError", step: int, phase: str | None) -> WorkerDied:
    text = str(e)
    field = dict(re.findall(r"^\t(class_name|pid): (\S+)$", text, re.M))
    who = f"{field.get('class_name', 'a Ray worker')}" + (f" (pid {field['pid']})" if "pid" in field else "")
    when = f"step {step}" + (f", phase {phase}" if phase else "")
    return WorkerDied(f"{who} died in {when}. Ray says: {text}")


class PhaseTimer(dict):
    phase: str | None = None  # the phase running (or the last one entered)

    @contextmanager
    def __call__(self, phase: str):
        self.phase = phase
        t0 = time.perf_counter()
        yield
        self[f"perf/{phase}_s"] = self.get(f"perf/{phase}_s", 0.0) + time.perf_counter() - t0


def ray_address(address: str, timeout_s: float) -> str:
    """The GCS address `ray.address` names (auto: RAY_ADDRESS, else the address file of the latest
    local cluster), once it answers; an error naming it when nothing listens there in timeout_s."""
    import os
    import socket
    import tempfile

    source = f"ray.address={address}"
    if address == "auto":
        file = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if os.environ.get("RAY_ADDRESS"):
            address, source = os.environ["RAY_ADDRESS"], f"ray.address=auto (RAY_ADDRESS={os.environ['RAY_ADDRESS']})"
        elif file.exists():
            address, source = file.read_text().strip(), f"ray.address=auto ({file}: {file.read_text().strip()})"
        else:
            raise ConnectionError(f"ray.address=auto: no running cluster (no RAY_ADDRESS, no {file}); start one with "
                                  "`ray start --head`, or leave ray.address unset for a fresh local cluster")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=min(2.0, timeout_s)).close()
            return address
        except (OSError, ValueError) as e:
            if time.monotonic() >= deadline or isinstance(e, ValueError):
                raise ConnectionError(f"{source}: no Ray cluster answers at {address} within ray.connect_timeout_s="
                                      f"{timeout_s:g} ({type(e).__name__}: {e}); a cluster left behind dead? "
                                      "`ray stop`, or leave ray.address unset for a fresh local cluster") from None
            time.sleep(0.5)


@contextmanager
def ray_cluster(address: str | None = None, timeout_s: float = 30.0):
    """A fresh local Ray cluster for this process (address unset: never one left behind by another
    run), or the existing cluster `address` names (auto, host:port, ray://host:port)."""
    started = not ray.is_initialized()
    if started:
        if address is None:
            ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=True)
        else:
            ray.init(address=ray_address(str(address), timeout_s), logging_level="ERROR", log_to_driver=True)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def run(cfg: DictConfig, run_dir: Path, name: str = "lockstep", overrides: tuple[str, ...] = ()) -> RunSummary:
    """One run of the RL loop. overrides: the command line's key=value overrides (an explicit model
    shape that contradicts model.init_from's config.json is an error; a model group's default is not)."""
    settings.validate(cfg)
    if (run_dir / METRICS_FILE).exists():  # its steps and this run's would mix in one file
        raise FileExistsError(f"hydra.run.dir={run_dir} already holds a run ({run_dir / METRICS_FILE}); run into a new "
                              f"directory (to continue that run: a new hydra.run.dir and trainer.resume={run_dir})")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RESOLVED_CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    data = load_records(cfg.data.path, cfg.data.prompt_key, cfg.data.label_key, cfg.data.skip_bad_rows)
    if data.skipped:
        log.warning("%s: skipped %d bad row(s) (data.skip_bad_rows=true); the first: %s", data.path,
                    len(data.skipped), data.skipped[0])
    records = data.records
    tokenizer = tokenizer_for([r.text() + r.label for r in records], cfg.model.init_from)
    tokenizer.save(run_dir / "tokenizer")
    model_config = settings.model_config(cfg, tokenizer.vocab_size, overrides)
    reward_fn = get_reward_fn(cfg.data.reward)
    prompts = PromptSampler(records, cfg.seed, cfg.data.shuffle)
    sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k,
                              cfg.rollout.max_new_tokens)
    summary = RunSummary(run_dir, cfg.determinism.mode, cfg.trainer.steps)

    checkpoint = resume.find(cfg.trainer.resume) if cfg.trainer.resume else None
    state = resume.check(checkpoint, cfg) if checkpoint else None  # before any worker starts
    actor_res = Resources(cfg.actor.num_cpus, cfg.actor.num_gpus)
    with ray_cluster(cfg.ray.address, cfg.ray.connect_timeout_s), placed(actor_res, Resources(cfg.rollout.num_cpus, cfg.rollout.num_gpus),
                               cfg.parallel.colocate, cfg.rollout.num_engines, actor_world_size(cfg),
                               engine_ranks(cfg)) as placement:
        actor = spawn_actor(cfg, placement, model_config, tokenizer)
        engines = spawn_rollouts(cfg, placement, model_config, tokenizer)
        gpu = Colocation(actor, engines, cfg)
        first = 1
        if checkpoint:
            actor.load(str(checkpoint))
            prompts.load_state_dict(state["prompts"])
            first = state["step"] + 1
            summary.resumed_from = str(checkpoint)
            log.info("resuming from %s: steps %d..%d", checkpoint, first, cfg.trainer.steps)
        gpu.sync(PhaseTimer())  # the actor's version (0, or the checkpoint's)
        tracker = Tracker(run_dir, OmegaConf.to_container(cfg.logger, resolve=True),
                          OmegaConf.to_container(cfg, resolve=True), cfg.trainer.steps, name,
                          run_id=state.get("tracker_run_id") if state else None)
        recorded = None  # the first mismatching step's record (consistency/record.py)
        warned_vacuous = False
        step, timer = 0, PhaseTimer()
        try:
            for step in range(first, cfg.trainer.steps + 1):
                timer, t_step = PhaseTimer(), time.perf_counter()
                batch = prompts.next_batch(cfg.rollout.prompts_per_step)
                seeds = [[sample_seed(cfg.seed, step, r.index, j) for j in range(cfg.rollout.n_samples)] for r in batch]
                with timer("rollout"):
                    rollout = engines.generate([tokenizer.encode_prompt(r.messages() or r.prompt) for r in batch],
                                               sampling, seeds)
                gpu.to_actor(timer)
                with timer("reward"):
                    group = torch.arange(len(batch)).repeat_interleave(cfg.rollout.n_samples)
                    texts = [tokenizer.decode(rollout.tokens[b, rollout.prompt_lens[b]:].tolist()) for b in range(rollout.batch_size)]
                    rewards = torch.tensor([reward_fn(batch[g].text(), t, batch[g].label) for g, t in zip(group.tolist(), texts)])
                with timer("logp"):
                    recomputed = actor.compute_logp(rollout)
                report = compare_logp(rollout.logp, recomputed.logp, rollout.response_mask(),
                                      rollout.response_tokens(), cfg.logger.worst_tokens)
                metrics = {**rollout_metrics(rollout, rewards, timer), **report.metrics()}
                if (vacuous := report.vacuous()) and not warned_vacuous:
                    log.warning("step %d: %s (warned once per run; metric consistency/certain_frac)", step, vacuous)
                    warned_vacuous = True
                hint = ""
                if report.mismatch_count and cfg.determinism.record_mismatch and recorded is None:
                    with timer("record"):
                        recorded = write_record(run_dir, step, rollout, recomputed.logp, actor.save_weights,
                                                tokenizer.vocab_size)
                    hint = f" Recorded in {recorded}: lockstep bisect {run_dir} --step {step} names the first op that differs."
                    log.warning("step %d: %d logprobs differ;%s", step, report.mismatch_count, hint)
                if settings.stops_on_mismatch(cfg) and report.mismatch_count:
                    tracker.log_step(step, {**metrics, **timer}, worst_rows(report, tokenizer))
                    summary.add(step, metrics)
                    raise_on_mismatch(report, step, hint)
                with timer("train"):
                    train_metrics = actor.train(rollout, rewards, group, recomputed.logp)
                check_importance_ratio(report, train_metrics, step)
                # checkpoints while the actor holds its weights (the sync offloads it when colocated)
                saving = cfg.trainer.save_every and (step % cfg.trainer.save_every == 0 or step == cfg.trainer.steps)
                if saving:
                    with timer("save"):
                        resume.save(run_dir, step, cfg, actor, tokenizer, prompts, tracker.run_id)
                if cfg.trainer.save_final and step == cfg.trainer.steps:
                    with timer("save_final"):
                        actor.save(str(run_dir / "checkpoint"))
                        tokenizer.save(run_dir / "checkpoint")
                gpu.sync(timer)
                timer["perf/step_s"] = time.perf_counter() - t_step
                metrics.update({f"train/{k}": v for k, v in train_metrics.items()}, **timer)
                tracker.log_step(step, metrics, worst_rows(report, tokenizer))
                summary.add(step, metrics)
                if saving:
                    resume.commit(run_dir, step, cfg.trainer.keep_checkpoints)
            summary.finish("completed")
        except ray.exceptions.RayActorError as e:  # a worker process died: say which, and when
            err = worker_died(e, step, timer.phase)
            summary.finish("failed", error=f"WorkerDied: {err}")
            raise err from e
        except BaseException as e:
            summary.finish("failed", error=f"{type(e).__name__}: {e}")
            raise
        finally:
            tracker.close(summary.status == "completed")
            collect_readbacks(run_dir, actor, engines)
    return summary


def collect_readbacks(run_dir: Path, actor, engines) -> None:
    """Evidence of what ran, from every worker, whatever happened (the validator needs it). A worker
    that died writes none: that is logged and the validator's readbacks gate reports the gap, so
    collecting never replaces the run's own first error with a secondary one."""
    for who, workers in (("actor", actor), ("rollout engines", engines)):
        try:
            workers.write_readbacks(str(run_dir))
        except Exception as e:  # noqa: BLE001 - a dead worker's RayActorError, whatever the worker
            log.warning("readbacks: the %s wrote none (%s: %s)", who, type(e).__name__, str(e).splitlines()[0])


class Colocation:
    """Who holds the GPU when. Colocated runs time-share it: the engines generate while the actor is
    offloaded (parameters, gradients, optimizer state on the host: actor.offload); after the
    rollout the engines sleep (KV cache freed, weights released) and the actor reloads to score and
    train; the weight sync wakes the engines' weights, streams the new ones into them, offloads the
    actor and only then wakes the KV cache. Each phase's GPU memory is logged on a GPU:
    perf/mem_used_gib/<phase> (the device, all processes, at the phase's end), perf/peak_mem_gib/<phase>
    (the peak allocation of the process that ran it) and perf/{actor,engine}_allocated_gib/<phase>
    (what that process holds at the phase's end)."""

    def __init__(self, actor, engines, cfg: DictConfig):
        self.actor, self.engines = actor, engines
        self.colocated = bool(cfg.parallel.colocate)
        offload = cfg.actor.offload
        self.offload = self.colocated and cfg.parallel.device == "cuda" if offload == "auto" else bool(offload)
        self.asleep = False  # the engines start awake: the first sync (before step 1) has nothing to wake

    def _memory(self, timer: "PhaseTimer", phase: str, worker, who: str) -> None:
        names = {"used_gib": "mem_used_gib", "peak_gib": "peak_mem_gib", "allocated_gib": f"{who}_allocated_gib"}
        for k, v in worker.memory().items():
            timer[f"perf/{names[k]}/{phase}"] = v

    def to_actor(self, timer: "PhaseTimer") -> None:
        self._memory(timer, "rollout", self.engines, "engine")
        if self.colocated:
            with timer("engine_sleep"):
                self.engines.sleep()
            self.asleep = True
        if self.offload:
            timer.update({f"perf/actor_{k}": v for k, v in self.actor.reload().items()})

    def sync(self, timer: "PhaseTimer") -> None:
        self._memory(timer, "train", self.actor, "actor")
        with timer("weight_sync"):
            if self.asleep:
                self.engines.wake("weights")
            parts = sync_weights(self.actor, self.engines.receive_bucket)
        timer.update({f"perf/weight_{k}": v for k, v in parts.items()})
        if self.offload:
            timer.update({f"perf/actor_{k}": v for k, v in self.actor.offload().items()})
        if self.asleep:
            with timer("engine_wake"):
                self.engines.wake("kv_cache")
            self.asleep = False
        self._memory(timer, "weight_sync", self.actor, "actor")  # the actor offloaded: what it keeps while engines generate


def rollout_metrics(rollout, rewards: torch.Tensor, timer: PhaseTimer) -> dict:
    n_tokens = int(rollout.response_lens.sum())
    return {"rollout/reward_mean": float(rewards.mean()),
            "rollout/response_len_mean": float(rollout.response_lens.float().mean()),
            "rollout/truncated_frac": float((~rollout.finished).float().mean()),
            "rollout/tok_per_s_per_gpu": n_tokens / timer["perf/rollout_s"],  # one device per engine here
            "rollout/weights_version": rollout.weights_version}


def worst_rows(report, tokenizer) -> list[dict]:
    return [{"sample": t.sample, "position": t.position, "token_id": t.token,
             "token": tokenizer.token(t.token), "rollout_logp": t.rollout_logp,
             "train_logp": t.train_logp, "abs_diff": t.abs_diff} for t in report.worst]


__all__ = ["run"]
