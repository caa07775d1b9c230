"""`forge train`'s loop: wait for episodes, compute advantages, update with veRL, publish and verify, commit.

One round, top to bottom (``Trainer.step``):
  1. episodes — complete episodes from the collector, whole GRPO groups, never one trained before and never an
     evaluation's (`forge eval`, run id `eval-…`):
     sync: every episode of the group served by exactly the current version v;
     async (near-on-policy): served by versions ≥ v − k; a group with an older episode is skipped whole (counted).
  2. rows + advantages — one row per segment (``trainer.batch``); veRL's estimator by name over episodes.
  3. old logprobs — the recorded behaviour logprobs (bypass: PPO's ratio is the importance correction), or, with
     ``--correction decoupled``, the trainer's recomputed ones plus veRL's rollout-correction IS weights
     (``rollout_corr_helper``) against the behaviour logprobs. Unknown (NaN) behaviour logprobs take the
     trainer's recomputed value either way.
  4. update — ``PolicyEngine.update`` (veRL's TrainingWorker + ppo_loss; ``--prefix-packing``: the token prefixes
     that rows share computed once per micro-batch, ``trainer.packing``).
  5. publish v+1 — checkpoint, load, cache reset, version, probe verification (``trainer.publish``), on every
     policy replica (``--policy-url``: a list, or ``dns+http://NAME:PORT``); one that fails is left out.
  6. commit — the engine's checkpoint (weights, optimizer) and ``state.json`` (step, version, trained episode ids),
     written after the publish landed; a crash before the commit replays the step from the last commit, so the
     committed state never holds an episode twice.
"""

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import time
import weakref
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.compute as pc
import torch
from tqdm import tqdm

from collector.collect import Collector, trainable
from collector.episode import is_evaluation
from forge.errors import ForgeError
from forge.paths import cache_dir
from sidecar.store import open_store
from trainer.batch import (
    Batch,
    baseline_mates,
    counted,
    episode_advantages,
    padded,
    parse_version,
    rows_from_segments,
)
from trainer.publish import (
    PROBE_IDS,
    PROBE_STEPS,
    TOLERANCE,
    PolicyClient,
    PolicyReplicas,
    PublishError,
    PublishResult,
    copy_checkpoint,
    load_root,
    mean_abs_diff,
    stage_checkpoint,
    write_checkpoint,
)

KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k2+", "k3+", "low_var_kl+")

CORRECTIONS = ("bypass", "decoupled")


class NothingReady(ForgeError):
    """Trainer.step(every_ready=True) found no whole group to train on."""


class NothingToLearn(NothingReady):
    """The step's episodes hold no row to learn from (every group flat, nothing trainable): they are consumed
    (``TrainState.skipped``), the version stays."""


@dataclass
class TrainSettings:
    store: str
    policy_url: str
    run: str = "default"
    mode: str = "sync"
    steps: int = 1
    episodes_per_step: int = 8
    staleness: int = 0
    lora_rank: int = 0
    algo: str = "grpo"
    loss_mode: str = "vanilla"
    lr: float = 1e-5
    correction: str = "bypass"
    rollout_is: str | None = None  # "token" | "sequence" with --correction decoupled
    rollout_is_threshold: float = 2.0
    wait_timeout: float = 600.0
    poll_seconds: float = 2.0
    resume: bool = False
    workers: int = 1
    model_dir: Path | None = None
    serving_dtype: str = "float32"
    s3_endpoint: str | None = None
    state_dir: Path | None = None
    idle_seconds: float = 600.0
    kl_coef: float = 0.0  # > 0: veRL's KL loss to the reference (the base weights; with LoRA, the adapter disabled)
    kl_type: str = "low_var_kl"  # veRL's kl_penalty by name
    workers_per_node: int = 0  # --workers over several nodes: ranks per node (0: all on one)
    max_token_len: int | None = None  # tokens per micro-batch (veRL's dynamic batch size); None: the engine's
    gradient_checkpointing: bool = False  # less memory per micro-batch, ~1.3x the compute (trainer.engine)
    epochs: int = 1  # optimizer steps over each step's batch (veRL's ppo_epochs; the PPO clip bounds the later ones)
    # Rows sharing a token prefix computed once per micro-batch (trainer.packing: the same loss and gradients; with
    # --workers each rank packs its own rows); veRL's own path where the model's attention takes no 4-D mask
    prefix_packing: bool = True
    seed: int = 1  # the engine's (LoRA's initial A matrix, dropout); the policy server's sampling is its own
    # Full weights are written here first, for the servers to load, and copied to the store beside the load:
    # "auto" (/dev/shm when every replica is on loopback), "store" (the store's copy is loaded), or a folder
    load_dir: str = "auto"


@dataclass
class TrainState:
    """What a resumed run continues from (``state.json``)."""

    step: int = 0
    version: int = 0
    trained: list[str] = field(default_factory=list)  # episode ids, in the order they were trained
    skipped: list[str] = field(default_factory=list)  # episodes of groups that aged out
    engine_checkpoint: str | None = None


def default_state_dir(settings: TrainSettings) -> Path:
    parsed = urlparse(settings.store)
    if parsed.scheme in ("", "file"):
        root = Path(os.path.abspath(parsed.path if parsed.scheme == "file" else settings.store))
        return root / "checkpoints" / settings.run / "trainer"
    key = hashlib.sha256(f"{settings.store.rstrip('/')}|{settings.run}".encode()).hexdigest()[:16]
    return cache_dir() / "trainer" / key


def select_groups(
    episodes: pa.Table, version: int, mode: str, staleness: int, exclude: set[str], wanted: int
) -> tuple[list[str], list[str], Counter]:
    """Episode ids to train on (whole groups, oldest first) and those of groups that aged out; why others wait.
    An evaluation's episodes (`forge eval`) are never chosen: counted as ``for_evaluation``."""
    waiting: Counter = Counter()
    groups: dict[str, list[dict]] = {}
    for ep in episodes.to_pylist():
        if ep["episode_id"] in exclude:
            continue
        if is_evaluation(ep["run_id"]):
            waiting["for_evaluation"] += 1
            continue
        groups.setdefault(ep["group_id"], []).append(ep)
    chosen: list[str] = []
    aged: list[str] = []
    oldest = version - (staleness if mode == "async" else 0)
    for _, members in sorted(groups.items(), key=lambda g: min(str(e["started_at"]) for e in g[1])):
        # A call whose weights are unknown (served by another model than the policy, or its version not known)
        # makes its episode off-policy to an unknown degree: never trained, counted, the group goes on without it.
        unknown = [e for e in members if e.get("n_version_unknown")]
        if unknown and all(e["status"] != "unfinished" for e in members):
            waiting["version_unknown"] += len(unknown)
            members = [e for e in members if not e.get("n_version_unknown")]
            if not members:
                continue
        lows = [parse_version(e["policy_version_min"]) or 0 for e in members]
        highs = [parse_version(e["policy_version_max"]) or 0 for e in members]
        if min(lows) < oldest:  # an episode older than allowed: the group goes whole, never split
            if all(e["status"] != "unfinished" for e in members):
                aged += [e["episode_id"] for e in members]
            waiting["aged_out"] += len(members)
            continue
        if any(e["status"] == "unfinished" for e in members):
            waiting["group_unfinished"] += len(members)
            continue
        if max(highs) > version:  # served by a version this trainer has not published: another run's
            waiting["newer_version"] += len(members)
            continue
        complete = [e["episode_id"] for e in members if e["status"] == "complete"]
        waiting["not_complete"] += len(members) - len(complete)
        if complete and len(chosen) < wanted:
            chosen += complete
    return chosen, aged, waiting


class Trainer:
    def __init__(self, settings: TrainSettings, echo=print) -> None:
        from trainer.serve import default_checkpoint

        self.settings = settings
        self.echo = echo
        if settings.mode not in ("sync", "async"):
            raise ForgeError(f"--mode must be sync or async, not {settings.mode!r}")
        if settings.correction not in CORRECTIONS:
            raise ForgeError(f"--correction must be one of {', '.join(CORRECTIONS)}")
        if settings.steps < 1 or settings.episodes_per_step < 1 or settings.staleness < 0:
            raise ForgeError("--steps and --episodes-per-step must be ≥ 1, --staleness ≥ 0")
        if settings.workers < 1:
            raise ForgeError("--workers must be ≥ 1")
        if settings.epochs < 1:
            raise ForgeError("--epochs must be ≥ 1")
        per_node = settings.workers_per_node
        if per_node < 0 or (per_node and settings.workers % per_node):
            raise ForgeError("--workers-per-node must divide --workers")
        if not (settings.kl_coef >= 0 and math.isfinite(settings.kl_coef)) or settings.kl_type not in KL_TYPES:
            raise ForgeError(f"--kl-coef must be a number ≥ 0 and --kl-type one of {', '.join(KL_TYPES)}")
        if settings.kl_coef > 0 and settings.workers > 1 and not settings.lora_rank:
            raise ForgeError("--kl-coef with full weights needs --workers 1 (or use --lora-rank): not built for Ray")
        self.collector = Collector(settings.store, settings.s3_endpoint, idle_seconds=settings.idle_seconds,
                                   progress=False)  # fmt: skip
        self.store = open_store(settings.store, settings.s3_endpoint)
        self.state_dir = settings.state_dir or default_state_dir(settings)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            probe = self.state_dir / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as error:
            raise ForgeError(f"cannot write the trainer's state to {self.state_dir}: {error.strerror}") from error
        self.model_dir = Path(settings.model_dir or default_checkpoint("float32"))
        if not (self.model_dir / "config.json").is_file():
            raise ForgeError(f"no HF checkpoint at {self.model_dir}: run `forge model prepare` or pass --model")
        self.replicas = PolicyReplicas(settings.policy_url)
        self.served_model = self.replicas.check()
        self.client: PolicyClient = self.replicas.clients()[0]  # the first replica (the only one, often)
        self.state = TrainState()
        state_file = self.state_dir / "state.json"
        if settings.resume and state_file.is_file():
            self.state = TrainState(**json.loads(state_file.read_text()))
        elif state_file.is_file() and not settings.resume:
            raise ForgeError(
                f"run {settings.run!r} already has state in {self.state_dir}: pass --resume or another --run"
            )
        self.adapter_name = f"forge-{settings.run}"
        # The served name of the policy under training: what every sampled call must be served by (the sidecars'
        # --policy-model). LoRA: the run's adapter, from v0 on; full weights: the server's own model.
        self.policy_name = self.adapter_name if settings.lora_rank else self.served_model
        self._engine: Any = None
        self._verify_v0 = False
        self.last_verify_split: dict[str, float] = {}
        # Each replica's last probe answer (the ids it sampled after PROBE_IDS and their logprobs): what it served
        # before the next publish, to tell a publish that did not land from one that did.
        self.server_probe: dict[str, tuple[list[int], list[float]]] = {}
        self.left_out: dict[str, str] = {}  # the last publish's replicas left out: URL -> why
        # Where full weights are written for the servers to load (trainer.publish.load_root), resolved now: a bad
        # --load-dir fails before the first update. Removed by close or, at the latest, when the process exits.
        self.load_folder: Path | None = None if settings.lora_rank else self._make_load_folder()
        self._claim_server()

    @property
    def engine(self) -> Any:
        """veRL's engine, built when the first batch is ready (bad input fails before the model loads)."""
        if self._engine is None:
            from trainer.engine import EngineSettings, PolicyEngine

            s = self.settings
            engine_settings = EngineSettings(model_dir=self.model_dir, lora_rank=s.lora_rank, lr=s.lr,
                                             loss_mode=s.loss_mode, kl_coef=s.kl_coef, kl_type=s.kl_type,
                                             gradient_checkpointing=s.gradient_checkpointing, epochs=s.epochs,
                                             seed=s.seed, prefix_packing=s.prefix_packing)  # fmt: skip
            if s.max_token_len:
                engine_settings.max_token_len = s.max_token_len
            if s.workers > 1:
                from trainer.workers import RayPolicyEngine

                self._engine = RayPolicyEngine(engine_settings, s.workers, s.workers_per_node)
            else:
                self._engine = PolicyEngine(engine_settings)
            if self.state.engine_checkpoint:
                self._engine.load(self.state_dir / self.state.engine_checkpoint)
            if self._verify_v0:
                self.verify(0, str(self.model_dir))
        return self._engine

    def _claim_server(self) -> None:
        """The server serves this run's committed version: set it at the start, re-published on a resume."""
        versions = {client.base_url: client.weight_version() for client in self.replicas.clients()}
        served = ", ".join(sorted({str(v) for v in versions.values()}))
        if self.state.step == 0 and self.state.version == 0:
            if set(versions.values()) - {None, "None", "default", "0"}:
                self.echo(f"forge train: the policy server reported version {served}; it is now version 0 of run "
                          f"{self.settings.run}")  # fmt: skip

            # v0 is the base checkpoint: loaded whatever the server served before, verified with the first batch.
            # With LoRA, v0 is also the engine's fresh adapter (B = 0: the base's outputs), written and loaded under
            # the policy's name, so every version of the run, v0 too, is served under one name.
            adapter = self._write(0) if self.settings.lora_rank else None

            def load_base(client: PolicyClient) -> None:  # with LoRA too: the adapter's base is the base checkpoint
                client.load_full(self.model_dir)
                if adapter is not None:
                    client.load_adapter(self.adapter_name, adapter)

            self._left_out(self.replicas.clients(), self._switch(load_base, 0), 0)
            if self._engine is not None:  # built for the adapter: verify now, else with the first batch
                self.verify(0, str(adapter))
            else:
                self._verify_v0 = True
        elif set(versions.values()) != {str(self.state.version)}:
            self.echo(f"forge train: resuming at v{self.state.version}; the server had {served}: re-publishing")
            self.publish(self.state.version)
        self.echo(f"forge train: the policy is served as {self.policy_name!r} by {self.replicas.base_url} (give the "
                  f"sidecars --policy-model {self.policy_name})")  # fmt: skip

    # ---- one round -------------------------------------------------------------------------------------------
    def run(self) -> None:
        while self.state.step < self.settings.steps:
            try:
                metrics = self.step()
            except NothingToLearn as error:  # consumed; wait for the next episodes
                metrics = {"step": self.state.step, "version": self.state.version, "nothing_to_learn": str(error)}
            line = json.dumps(metrics, default=_json_default)
            with (self.state_dir / "metrics.jsonl").open("a") as out:
                out.write(line + "\n")
            print(line, flush=True)

    def step(self, every_ready: bool = False) -> dict[str, Any]:
        """One update, publish and commit. every_ready: on every whole group ready now, without waiting for
        --episodes-per-step (forge demo's rounds); NothingReady when there is none."""
        s, version = self.settings, self.state.version
        segments, episode_ids, aged, ages, mates = self.wait_for_episodes(every_ready)
        batch = rows_from_segments(segments, mates)
        advantage = episode_advantages(batch.episodes, s.algo) if batch.episodes else {}
        # With a KL term a flat group still has a gradient (towards the reference): then it stays.
        flat_groups = batch.leave_out_flat_groups() if s.kl_coef == 0 else 0
        if not batch.rows:  # consumed all the same: they never become trainable, nor are they waited for again
            self.skip(episode_ids + aged + sorted(mates))
            raise NothingToLearn(
                f"the {len(episode_ids)} episodes of v{version} hold nothing to learn from: "
                + counted(batch.skipped, "segments")
            )
        tensors, metrics = update_inputs(
            batch, advantage, s.correction, s.rollout_is, s.rollout_is_threshold, lambda t: self.engine.log_probs(t)
        )
        mask, unknown = tensors["response_mask"].bool(), metrics.pop("_unknown")
        tokens = int(mask.sum())
        if s.kl_coef > 0:  # veRL's ppo_loss adds kl_penalty(log_prob, ref_log_prob) × kl_coef
            tensors["ref_log_prob"] = self.engine.log_probs(tensors, reference=True)[0] * mask
        started = time.perf_counter()
        update = self.engine.update(tensors)
        update_s = time.perf_counter() - started
        published = self.publish(version + 1)
        self.commit(episode_ids, aged + sorted(mates), version + 1)  # a mate counts in one baseline only
        rewards = torch.tensor([reward for _, reward in batch.episodes.values()])
        advantages = torch.tensor([advantage[e] for e in batch.episode_ids])  # the episodes trained
        metrics.update({
            "step": self.state.step, "version": self.state.version, "episodes": len(episode_ids),
            "segments": len(batch), "groups_aged_out_episodes": len(aged), "skipped_segments": batch.skipped,
            "zero_variance_groups_left_out": flat_groups,
            "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "advantage_mean": advantages.mean().item(), "advantage_abs_mean": advantages.abs().mean().item(),
            "kl_behaviour": _first(update, "actor/ppo_kl"), "clip_frac": _first(update, "actor/pg_clipfrac"),
            "pg_loss": _first(update, "actor/pg_loss"), "grad_norm": _first(update, "grad_norm"),
            "entropy": metrics.get("entropy", _first(update, "actor/entropy_loss")),
            "staleness": dict(sorted(Counter(ages).items())), "tokens_trained": tokens,
            "tokens_unknown_logprob": int(unknown.sum()), "update_s": update_s,
            "tokens_per_s": tokens / update_s if update_s else 0.0,
            "publish_s": sum(published.seconds.values()), **{f"publish_{k}_s": v for k, v in published.seconds.items()},
            "probe_diff": published.probe_diff, "probe_diff_old": published.probe_diff_old,
            "replicas": len(published.replicas), "replicas_left_out": published.left_out,
            # What went through the model (trainer.packing): tokens, and positions whose logits were computed
            **{k.split("/")[1]: v for k, v in update.items() if k.startswith("packing/")},
        })  # fmt: skip
        if s.kl_coef > 0:  # veRL's ppo_loss reports it as "kl_loss" (no "actor/" prefix)
            metrics["kl_ref"] = _first(update, "kl_loss")
            if not math.isfinite(metrics["kl_ref"]):
                raise ForgeError("veRL reported no finite kl_loss with --kl-coef: the KL term did not run")
        return metrics

    def wait_for_episodes(
        self, every_ready: bool = False
    ) -> tuple[pa.Table, list[str], list[str], list[int], dict[str, tuple[str, float]]]:
        """Poll the collector until enough whole groups are ready (bounded by --wait-timeout, with a bar); with
        every_ready, take every whole group ready now (NothingReady when none is)."""
        s, version = self.settings, self.state.version
        exclude = set(self.state.trained) | set(self.state.skipped)
        deadline = time.monotonic() + s.wait_timeout
        wanted = 1 << 30 if every_ready else s.episodes_per_step
        bar = tqdm(total=s.episodes_per_step, desc=f"episodes of v{version}", unit="ep", leave=False,
                   disable=True if every_ready else None, file=sys.stderr)  # fmt: skip
        try:
            while True:
                collection = self.collector.update()
                chosen, aged, waiting = select_groups(collection.episodes, version, s.mode, s.staleness, exclude,
                                                      wanted)  # fmt: skip
                bar.n = min(len(chosen), s.episodes_per_step)
                bar.refresh()
                if every_ready and not chosen:
                    why = counted(waiting) or "no episodes"
                    raise NothingReady(f"no whole group of v{version} is ready in {s.store} ({why})")
                if every_ready or len(chosen) >= s.episodes_per_step:
                    break
                if time.monotonic() >= deadline:
                    why = counted(waiting) or "no episodes"
                    raise ForgeError(f"only {len(chosen)} of {s.episodes_per_step} complete episodes for v{version} "
                                     f"after {s.wait_timeout:.0f} s in {s.store} ({why})")  # fmt: skip
                time.sleep(s.poll_seconds)
        finally:
            bar.close()
        segments = trainable(collection.segments)
        segments = segments.filter(pc.is_in(segments["episode_id"], pa.array(chosen, pa.string())))
        ep = collection.episodes.filter(pc.is_in(collection.episodes["episode_id"], pa.array(chosen, pa.string())))
        ages = [version - (parse_version(v) or 0) for v in ep["policy_version_min"].to_pylist()]
        return segments, chosen, aged, ages, baseline_mates(collection.episodes, chosen, exclude)

    # ---- publish and commit ----------------------------------------------------------------------------------
    def publish(self, version: int) -> PublishResult:
        """Write, then switch every replica (paused) and probe each: its answer must be the new weights'. Full
        weights with a load folder (``load_dir``) are loaded from there while the store's copy is written."""
        seconds: dict[str, float] = {}
        started = time.perf_counter()
        root = self.load_folder
        with ThreadPoolExecutor(2, thread_name_prefix="forge-publish") as pool:
            stored: Future | None = None
            if root is None:
                path = self._write(version)
            else:
                path = root / f"v{version}"
                try:
                    stage_checkpoint(path, self.settings.run, version, self.engine.save_weights, self.model_dir,
                                     f"v{version} to the load folder {root}")  # fmt: skip
                except ForgeError as error:  # e.g. the tmpfs filled up since: this one goes the store's way
                    self.echo(f"forge train: {error}; v{version} is loaded from the store's copy")
                    root, path = None, self._write(version)
                else:
                    stored = pool.submit(copy_checkpoint, self.store, self.settings.run, version, path,
                                         self.state_dir)  # fmt: skip
            seconds["write"] = time.perf_counter() - started
            clients = self.replicas.clients()
            before = {c.base_url: self.server_probe.get(c.base_url)
                      or c.probe(self.policy_name, PROBE_IDS, PROBE_STEPS) for c in clients}  # fmt: skip
            # The engine teacher-forces the server's previous probe ids while the server loads: one update rarely
            # changes them (when it does, verify computes the new ones after the server's answer).
            guess_ids = before[clients[0].base_url][0]
            guess = pool.submit(self._probe_logprobs, guess_ids)
            started = time.perf_counter()
            if self.settings.lora_rank:
                failed = self._switch(lambda c: c.load_adapter(self.adapter_name, path), version, clients)
            else:
                failed = self._switch(lambda c: self._load_full(c, path, stored), version, clients)
            seconds["load"] = time.perf_counter() - started
            started = time.perf_counter()
            result = self.verify(version, str(path), before, (guess_ids, guess), failed, clients)
            seconds["verify"] = time.perf_counter() - started
            if stored is not None and root is not None:
                started = time.perf_counter()
                try:  # the store's copy is the version's checkpoint: a publish without it fails
                    result.path = str(stored.result())
                except ForgeError as error:  # no sidecar may record calls as a version the store does not hold
                    for client in clients:
                        if client.base_url in result.replicas:
                            self.replicas.leave_out(client, version)
                    raise PublishError(f"v{version} was loaded, but {error}: its replicas are relabelled "
                                       f"left-out-v{version} and the run stops") from error  # fmt: skip
                seconds["store"] = time.perf_counter() - started  # what the copy took beyond load and verify
                for old in root.glob("v*"):  # earlier versions: no server loads them again
                    if old.name != path.name:
                        shutil.rmtree(old, ignore_errors=True)
        result.seconds = seconds
        return result

    def _make_load_folder(self) -> Path | None:
        size = sum(p.stat().st_size for p in self.model_dir.glob("*.safetensors"))
        folder = load_root(self.settings.load_dir, [c.base_url for c in self.replicas.clients()], size)
        if folder is not None:
            self._drop_load_folder = weakref.finalize(self, shutil.rmtree, folder, True)  # once: close or exit
            self.echo(f"forge train: full weights are written to {folder} for the policy servers to load, and "
                      "copied to the store beside the load (--load-dir store: load the store's copy)")  # fmt: skip
        return folder

    def _load_full(self, client: PolicyClient, path: Path, stored: Future | None) -> None:
        """Full weights from the load folder; a replica that refuses it (it sees another machine's or a container's
        file system: vLLM answers HTTP 500, its weights untouched) loads the store's local copy instead. An
        unreachable replica or a timeout is not tried again (it is left out)."""
        try:
            client.load_full(path)
        except PublishError as error:
            if stored is None or error.status is None:
                raise
            store_path = stored.result()
            self.echo(f"forge train: {client.base_url} did not load {path} ({str(error)[:200]}); loading the "
                      f"store's copy {store_path}")  # fmt: skip
            client.load_full(store_path)

    def _write(self, version: int) -> Path:
        return write_checkpoint(self.store, self.settings.run, version, self.engine.save_weights, self.model_dir,
                                self.state_dir)  # fmt: skip

    def _switch(
        self, load: Callable[[PolicyClient], None], version: int, clients: list[PolicyClient] | None = None
    ) -> dict[str, str]:  # fmt: skip
        """Every replica paused, so nothing is computed between the load and the version: a call whose tokens meet
        the new weights ends after the version changed, and the sidecar records it as spanning both. Returns the
        replicas that failed (URL -> why); every one is resumed."""
        return self.replicas.switch(clients or self.replicas.clients(), load, version)

    def _left_out(self, clients: list[PolicyClient], failed: dict[str, str], version: int) -> list[str]:
        """Relabel the replicas that failed (no sidecar routes to them), say which; the ones that landed, or
        PublishError when none did."""
        for client in clients:
            if client.base_url in failed:
                self.replicas.leave_out(client, version)
        self.left_out = dict(failed)
        landed = [c.base_url for c in clients if c.base_url not in failed]
        if not landed:
            whys = "; ".join(f"{url}: {why}" for url, why in failed.items())
            raise PublishError(whys if len(clients) == 1 else f"publish of v{version} landed on no replica: {whys}")
        for url, why in failed.items():
            self.echo(f"forge train: v{version} left out the policy replica {url} (its version is now "
                      f"left-out-v{version} where it answers; the sidecars route around it): {why}")  # fmt: skip
        return landed

    def verify(
        self, version: int, path: str, before: dict[str, tuple[list[int], list[float]]] | None = None,
        guess: tuple[list[int], Future] | None = None, failed: dict[str, str] | None = None,
        clients: list[PolicyClient] | None = None,
    ) -> PublishResult:  # fmt: skip
        """Each replica's probe — its seeded continuation of PROBE_IDS and those tokens' logprobs — is the trainer's
        under the new weights (teacher-forcing the replica's ids), and, where the update moved them, not what the
        replica answered before (``before``: each replica's probe answer before the load; ``guess``: ids and the
        engine's logprobs of them, computed meanwhile). A replica that fails (or ``failed`` already) is left out."""
        clients = clients or self.replicas.clients()
        failed = dict(failed or {})
        started = time.perf_counter()
        answers: dict[str, tuple[list[int], list[float]]] = {}

        def probe(client: PolicyClient) -> None:
            answers[client.base_url] = client.probe(self.policy_name, PROBE_IDS, PROBE_STEPS)
            if (served_version := client.weight_version()) != str(version):
                raise PublishError(f"the policy server reports version {served_version}, not {version}")

        failed |= self.replicas.each([c for c in clients if c.base_url not in failed], probe)
        server_s = time.perf_counter() - started
        started = time.perf_counter()
        forced: dict[tuple[int, ...], list[float]] = {}
        if guess is not None:
            forced[tuple(guess[0])] = guess[1].result()  # the engine is free again: never used twice at once
        tolerance = TOLERANCE.get(self.settings.serving_dtype, TOLERANCE["auto"])
        diffs, diffs_old = [], []
        for url, (ids, served) in answers.items():
            if url in failed:
                continue
            if tuple(ids) not in forced:
                forced[tuple(ids)] = self._probe_logprobs(ids)
            new = forced[tuple(ids)]
            old_ids, old = (before or {}).get(url) or (ids, new)
            diff, diff_old = mean_abs_diff(served, new), mean_abs_diff(served, old)
            # Same ids as before: the logprobs must have moved as the weights did. Other ids: the server's own
            # seeded sample changed, which unchanged weights do not do.
            moved = mean_abs_diff(new, old) if ids == old_ids else 0.0
            if not diff <= tolerance or (moved > tolerance and not diff < diff_old):
                failed[url] = (
                    f"publish of v{version} did not land: the server's probe logprobs differ from the new weights' "
                    f"by {diff:.2e} (tolerance {tolerance:.0e}) and from its own answer before the load by "
                    f"{diff_old:.2e}"
                )  # fmt: skip
                continue
            diffs.append(diff)
            diffs_old.append(diff_old)
        self.last_verify_split = {"server_probe": server_s, "trainer_probe": time.perf_counter() - started}
        landed = self._left_out(clients, failed, version)
        self.server_probe = {url: answers[url] for url in landed}
        return PublishResult(version, path, probe_diff=max(diffs), probe_diff_old=min(diffs_old), replicas=landed,
                             left_out=failed)  # fmt: skip

    def _probe_logprobs(self, ids: list[int]) -> list[float]:
        """The engine's logprobs of ``ids`` after PROBE_IDS (the server's probe answer, teacher-forced)."""
        from trainer.batch import Row

        row = Row("probe", "probe", 0, PROBE_IDS, ids, [1] * len(ids), [0.0] * len(ids), 0.0, None)
        log_probs, _ = self.engine.log_probs(padded([row]))
        return [float(x) for x in log_probs[0].tolist()]

    def close(self) -> None:
        """Shut down what the engine started (a Ray worker group and the local Ray); drop the load folder (the
        store keeps every version)."""
        if self.load_folder is not None:
            self._drop_load_folder()
            self.load_folder = None
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def skip(self, episode_ids: list[str]) -> None:
        """Consume episodes without an update: the step, the version and the engine's checkpoint stay."""
        self.state = replace(self.state, skipped=self.state.skipped + episode_ids)
        self._write_state()

    def commit(self, episode_ids: list[str], aged: list[str], version: int) -> None:
        step = self.state.step + 1
        name = f"engine-step-{step}"
        target = self.state_dir / name
        shutil.rmtree(target, ignore_errors=True)
        self.engine.save(target, step)
        previous = self.state.engine_checkpoint
        self.state = TrainState(step=step, version=version, trained=self.state.trained + episode_ids,
                                skipped=self.state.skipped + aged, engine_checkpoint=name)  # fmt: skip
        self._write_state()
        if previous and previous != name:
            shutil.rmtree(self.state_dir / previous, ignore_errors=True)

    def _write_state(self) -> None:
        staging = self.state_dir / ".state.json.tmp"
        staging.write_text(json.dumps(asdict(self.state)))
        os.replace(staging, self.state_dir / "state.json")


def update_inputs(
    batch: Batch, advantage: dict[str, float], correction: str, rollout_is: str | None, threshold: float,
    log_probs: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:  # fmt: skip
    """The tensors ``ppo_loss`` reads: advantages (per episode, ``episode_advantages``), old logprobs and,
    decoupled, IS weights.

    ``log_probs`` (the engine's current logprobs) is called only when needed: for unknown behaviour logprobs and
    for the decoupled correction. Bypass on data without unknowns never recomputes: sync and async (any k) then
    feed veRL exactly the same tensors for the same episodes.
    """
    tensors = padded(batch.rows)
    mask = tensors["response_mask"].bool()
    tensors["advantages"] = torch.tensor([advantage[r.episode_id] for r in batch.rows])[:, None] * mask
    rollout = tensors.pop("rollout_log_probs")
    unknown = torch.isnan(rollout) & mask
    metrics: dict[str, Any] = {"_unknown": unknown}
    recomputed = torch.zeros_like(rollout)
    if correction == "decoupled" or unknown.any():
        recomputed, entropy = log_probs(tensors)
        metrics["entropy"] = _masked_mean(entropy, mask)
    behaviour = torch.where(unknown, recomputed, torch.nan_to_num(rollout)) * mask
    if correction == "decoupled":
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

        tensors["old_log_probs"] = recomputed * mask
        weights, _, corr = compute_rollout_correction_and_rejection_mask(
            old_log_prob=recomputed, rollout_log_prob=behaviour, response_mask=mask.float(),
            rollout_is=rollout_is or "token", rollout_is_threshold=threshold,
        )  # fmt: skip
        w = weights.batch["rollout_is_weights"] if weights is not None else torch.ones_like(recomputed)
        tensors["rollout_is_weights"] = w * mask
        metrics.update(_is_stats(tensors["rollout_is_weights"], mask))
        metrics.update({f"is/{k.split('/')[-1]}": _scalar(v) for k, v in corr.items() if _is_number(v)})
    else:
        tensors["old_log_probs"] = behaviour
    return tensors, metrics


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1))


def _is_stats(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    picked = weights[mask]
    return {"is_weight_mean": float(picked.mean()), "is_weight_min": float(picked.min()),
            "is_weight_max": float(picked.max())}  # fmt: skip


def _first(metrics: dict[str, Any], key: str) -> float:
    value = metrics.get(key)
    if isinstance(value, list):
        value = sum(float(_scalar(v)) for v in value) / len(value) if value else None
    return float(_scalar(value)) if value is not None else math.nan


def _scalar(value: Any) -> Any:
    if hasattr(value, "value"):  # veRL's Metric
        value = value.value
    if isinstance(value, torch.Tensor):
        value = value.item()
    with contextlib.suppress(TypeError, ValueError):
        return float(value)
    return value


def _is_number(value: Any) -> bool:
    return isinstance(_scalar(value), float) and math.isfinite(_scalar(value))


def _json_default(value: Any) -> Any:
    return _scalar(value)
