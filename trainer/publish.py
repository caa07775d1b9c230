"""Publishing a policy version: checkpoint to the store, load into vLLM, set its version, verify that it landed.

The server is paused around the switch (``POST /pause?mode=keep`` … ``POST /resume``): vLLM 0.32 then computes
nothing (calls in flight are frozen with their KV, new ones queue), so no token is computed with the new weights
before the version says so, and a call that spans the switch ends after it: the sidecar, which asks the version
before and after each call, records it as ``v``–``v+1``. (vLLM 0.32's other modes: ``abort``, the default, fails
the calls in flight; ``wait`` drains them first, unbounded. In every mode a new request — the probe too — waits
for ``/resume``, so the probe runs after it.)

1. Checkpoint: ``<store>/checkpoints/<run>/v<n>/`` holds either full weights (``model.safetensors`` + the base
   model's config and tokenizer: an HF folder vLLM and transformers load) or a LoRA adapter
   (``adapter_model.safetensors`` + ``adapter_config.json``). It is written under a hidden name and renamed, so a
   reader never sees half a checkpoint; on S3 every file is uploaded first and ``_PUBLISHED.json`` last. Full
   weights with a load folder (``load_root``: /dev/shm when the servers share this machine) are written there
   first and loaded from there, while the store's copy is written beside the load (``copy_checkpoint``).
2. Load: full weights through ``POST /collective_rpc reload_weights``; an adapter is unloaded, then loaded
   (never ``load_inplace``, which has been seen to keep serving the adapter it read first).
3. Prefix cache: ``POST /reset_prefix_cache`` after the load, so no later call is served from KV computed with
   the old weights (the sidecar does not need to salt requests; vLLM answers ``success: false`` while requests
   hold blocks: it is retried, and a reset that never succeeds fails the publish).
4. ``POST /update_weight_version``: the sidecar reads it from ``/weight_info`` and records it per call.
5. Verify: the server continues a fixed prompt by 8 ids, sampled at temperature 1 with a fixed seed, and gives
   their logprobs; the trainer teacher-forces those ids under the new weights: the logprobs must agree within a
   dtype tolerance and, where the update moved them, differ from the server's own answer before the load (kept
   from the previous publish). Otherwise ``PublishError``: the run stops, nothing trains as if the version had
   landed. At temperature 1 with nothing else shaping the distribution the logprobs are the weights' own, whichever
   ``--logprobs-mode`` the server runs (``forge serve``: processed, which restricting the probe to a fixed token
   with ``allowed_token_ids`` would turn into 0); sampled rather than greedy, so the ids are the less certain ones
   an update moves (greedy ids' logprobs sit near 0 and moved ~3e-4 in a step that moved sampled ones more); never
   ``prompt_logprobs``: on a
   LoRA-enabled vLLM 0.32 CPU server a ``prompt_logprobs`` request batched with any other request kills the engine
   (vllm#29955/#16668), and the probe runs while the calls frozen by the pause resume. A fresh ``cache_salt`` keeps
   it off the prefix cache.

Several replicas (``PolicyReplicas``: the sidecar's replica spec, a list or ``dns+http://NAME:PORT``): every one is
paused, then each loads the checkpoint and has its prefix cache reset, then the version is set on each that loaded,
then every one resumes, then each is verified with the probe (a paused engine queues every request, the probe too,
so the probe follows the resume). A replica that fails a step is left out: its version becomes
``left-out-v<n>``, so the sidecars, which route only to replicas whose version and policy name match the others',
stop sending episodes there; the publish lands on the
rest and says which were left out. It fails only when none landed. The replica that failed its probe served the
new version's number for the probe's duration (~0.1–1 s) before it was relabelled: the one window left.
"""

import contextlib
import errno
import json
import math
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from forge.errors import ForgeError
from sidecar.policy import PolicyServerClient, PolicyServerError
from sidecar.replicas import Resolver, UpstreamError, base_url, parse_upstreams, resolve
from sidecar.store import Store
from sidecar.version import version_text

# The probe: fixed ids, no tokenizer at run time (SmolLM2's chat template of a short question and answer; for another
# model only the ids' range matters: every id < 49152).
PROBE_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198,
    1, 4093, 198, 5820, 253, 9552, 1230, 284, 1643, 1701, 357, 314, 9552, 30, 2, 198, 1, 520, 9531, 198, 40357, 42,
    805, 582, 284, 4962, 10335, 357, 30, 2, 198,
]  # fmt: skip
PROBE_STEPS = 8  # sampled tokens after PROBE_IDS: the probe's 8 positions (1 prefill + 7 decode steps)
PROBE_SEED = 20261205  # the probe's sampling seed: the same weights sample the same ids
# Mean |server − trainer| over the probe a landed publish stays under (fp32 serving measured ~1e-5; bf16 ~5e-2).
TOLERANCE = {"float32": 2e-4, "bfloat16": 1.5e-1, "float16": 5e-2, "auto": 1.5e-1}


class PublishError(ForgeError):
    """A publish that did not land: the run must not go on as if it had."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the policy server's HTTP status when it refused a step (None: unreachable, other)


@dataclass
class PublishResult:
    version: int
    path: str
    seconds: dict[str, float] = field(default_factory=dict)  # write, load, verify (+ store: a load folder's copy)
    probe_diff: float = math.nan  # mean |server − trainer(new)| over the probe
    probe_diff_old: float = math.nan  # mean |server − its answer before the load|: 0 for a publish that did not land
    replicas: list[str] = field(default_factory=list)  # the replicas that serve it
    left_out: dict[str, str] = field(default_factory=dict)  # replica URL -> why it does not


def checkpoint_name(run: str, version: int) -> str:
    return f"checkpoints/{run}/v{version}"


_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """The safetensors format written straight from the tensors' memory: no serialised copy of the whole file
    (``safetensors.torch.save_file`` builds one: 540 MB for SmolLM2 in fp32) and one ``write`` per tensor."""
    header: dict[str, Any] = {"__metadata__": metadata or {}}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb", buffering=0) as out:
        out.write(len(encoded).to_bytes(8, "little") + encoded)
        for tensor in tensors.values():
            if tensor.numel():
                out.write(tensor.reshape(-1).view(torch.uint8).numpy().data)


def write_checkpoint(
    store: Store, run: str, version: int, save: Callable[[Path], None], base_model: Path | None,
    local_dir: Path | None = None,
) -> Path:  # fmt: skip
    """Write version ``version`` atomically; returns the local folder vLLM loads (the store's on a local store).

    ``save(folder)`` writes the weights (``PolicyEngine.save_weights``: ``model.safetensors`` or a LoRA adapter);
    the base model's config and tokenizer join full weights, so the folder is an HF checkpoint (``base_model``
    None: ``save`` wrote them)."""
    relative = checkpoint_name(run, version)
    if store.is_local:
        final = Path(store.path(relative))
    else:
        final = (local_dir or Path(os.environ.get("TMPDIR", "/tmp"))) / "forge-checkpoints" / relative
    stage_checkpoint(final, run, version, save, base_model, f"{relative} to {store.uri}")
    if not store.is_local:
        upload_checkpoint(store, relative, final)
    return final


def stage_checkpoint(
    final: Path, run: str, version: int, save: Callable[[Path], None], base_model: Path | None, where: str
) -> None:  # fmt: skip
    """The checkpoint in ``final``, written under a hidden name and renamed: a reader never sees half of it.
    Full weights get ``base_model``'s config and tokenizer beside them (None: ``save`` copies them)."""
    staging = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        staging.mkdir(parents=True)
        save(staging)
        if base_model is not None and (staging / "model.safetensors").is_file():
            for name in os.listdir(base_model):  # config, generation config, tokenizer: the HF folder's rest
                if name.endswith((".json", ".jinja", ".txt")) and not name.startswith((".", "model.safetensors")):
                    _link_or_copy(base_model / name, staging / name)
        (staging / "_PUBLISHED.json").write_text(json.dumps({"run": run, "version": version, "at": time.time()}))
        for written in staging.iterdir():
            if written.stat().st_mode & 0o777 != 0o644:  # linked base files are already; vLLM may be another uid
                written.chmod(0o644)
        staging.chmod(0o755)
        if final.exists():  # a version written by a run that died before verifying it: replaced whole
            shutil.rmtree(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, final)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise ForgeError(f"cannot write the checkpoint {where}: {error}") from error


def upload_checkpoint(store: Store, relative: str, folder: Path) -> None:
    """A finished local checkpoint folder to an object store, ``_PUBLISHED.json`` last."""
    try:
        for path in sorted(folder.iterdir(), key=lambda p: p.name == "_PUBLISHED.json"):  # the marker last
            with store.filesystem.open_output_stream(store.path(f"{relative}/{path.name}")) as out:
                out.write(path.read_bytes())
    except OSError as error:
        raise ForgeError(f"cannot upload the checkpoint {relative} to {store.uri}: {error}") from error


def copy_checkpoint(store: Store, run: str, version: int, source: Path, local_dir: Path | None = None) -> Path:
    """A checkpoint written in a load folder (``source``, e.g. on tmpfs) copied where ``write_checkpoint`` writes
    one (an object store: the local folder under ``local_dir``, then uploaded); returns that local folder."""

    def copy(staging: Path) -> None:
        for path in source.iterdir():
            if path.name != "_PUBLISHED.json":
                shutil.copyfile(path, staging / path.name)  # sendfile: a kernel-side copy

    return write_checkpoint(store, run, version, copy, None, local_dir)


def load_root(setting: str | None, urls: list[str], size: int) -> Path | None:
    """Where a full-weights checkpoint is written for the policy servers to load, before (and beside) the store's
    copy: ``setting`` a folder, ``"store"`` (none: the store's copy is loaded), or ``"auto"``: a new folder of the
    trainer's own on /dev/shm when every replica listens on loopback (the servers share this machine) and the tmpfs
    has room for two checkpoints of ``size`` bytes (else none). A tmpfs write waits on no disk write-back: 0.17 s for
    SmolLM2's 540 MB, where the disk's took 0.14-0.9 s. A replica that refuses the path (it cannot read it) loads
    the store's local copy instead."""
    if setting in (None, "", "store"):
        return None
    if setting != "auto":
        root = Path(setting)
        try:
            root.mkdir(parents=True, exist_ok=True)
            safe_parent(root)
            return _own_folder(root)
        except OSError as error:
            raise ForgeError(f"--load-dir {setting}: {error.strerror or error}") from None
    shm = Path("/dev/shm")
    loopback = all(urlparse(url).hostname in ("127.0.0.1", "localhost", "::1") for url in urls)
    try:
        if not loopback or shutil.disk_usage(shm).free < 2 * size or not os.access(shm, os.W_OK):
            return None
        safe_parent(shm)
        return _own_folder(shm)
    except OSError:
        return None


def safe_parent(folder: Path) -> None:
    """The load folder's parent must not let another user move our folder away and put theirs in its place: a real
    folder (not a link), owned by us or root, writable only by its owner unless sticky (/dev/shm, /tmp: there
    nobody but its owner renames an entry)."""
    info = os.lstat(folder)
    shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid not in (0, os.getuid())
            or (shared and not info.st_mode & stat.S_ISVTX)):  # fmt: skip
        raise OSError(errno.EPERM, "another user could replace what is written there (it must be a folder owned by "
                                   "you or root, writable by others only if sticky)")  # fmt: skip


LOAD_PREFIX = "openforge-load-"  # + the trainer's pid + "-" + mkdtemp's random part


def _own_folder(parent: Path) -> Path:
    """A new folder of a name nobody could have made before (a shared /dev/shm), only its owner writes to it;
    readable by all, as the store's checkpoints: the server may run as another uid. The folders that trainers
    killed before their cleanup left there (named with their pid, ours, the pid gone) are removed first."""
    sweep_dead(parent)
    folder = Path(tempfile.mkdtemp(prefix=f"{LOAD_PREFIX}{os.getpid()}-", dir=parent))
    folder.chmod(0o755)
    return folder


def sweep_dead(parent: Path) -> list[Path]:
    """Remove the load folders in ``parent`` whose trainer died without removing its own (``kill -9``: tmpfs
    holds a checkpoint until reboot): ours (same uid), real folders, named for a pid no process has now."""
    removed = []
    for entry in os.scandir(parent):
        pid = entry.name.removeprefix(LOAD_PREFIX).split("-", 1)[0]
        if not entry.name.startswith(LOAD_PREFIX) or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
        except (OSError, OverflowError):  # alive (another uid's process: EPERM), gone meanwhile, or no pid at all
            continue
    return removed


def _link_or_copy(source: Path, target: Path) -> None:
    """The base model's small files: a hard link where the store shares its file system, else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def json_value(value: Any) -> Any:
    """peft's config values JSON cannot hold: enums by value (``"LORA"``, ``"CAUSAL_LM"``), sets as lists."""
    if hasattr(value, "value"):
        return value.value
    if isinstance(value, set | frozenset):
        return sorted(value)
    return str(value)


class PolicyClient:
    """The weight endpoints of one vLLM server (``forge serve`` starts it with them enabled), over the policy server's
    one HTTP client (``sidecar.policy.PolicyServerClient``)."""

    def __init__(self, base_url: str, timeout: float = 300.0) -> None:  # reloads stalled >120 s on a loaded box
        self.http = PolicyServerClient(base_url, timeout=timeout)
        self.base_url = self.http.base_url

    def _post(self, path: str, payload: dict | None = None, what: str = "") -> Any:
        try:
            return self.http.post(path, payload)
        except PolicyServerError as error:
            if error.status is None:
                raise PublishError(
                    f"the policy server at {self.base_url} is unreachable ({what or path}): {error.__cause__ or error}"
                ) from error
            raise PublishError(f"the policy server refused {what or path}: HTTP {error.status} {error.body}",
                               status=error.status) from None  # fmt: skip

    def check(self) -> str:
        """The served model's name, or a one-line error when the server is down."""
        try:
            return str(self.http.get("/v1/models", timeout=10)["data"][0]["id"])
        except (PolicyServerError, KeyError, IndexError, TypeError) as error:
            raise ForgeError(
                f"no policy server answers at {self.base_url}: start one (`forge serve`) or fix --policy-url"
            ) from error

    def weight_version(self) -> str | None:
        return version_text(self.http.get("/weight_info", timeout=10))

    def load_full(self, directory: Path) -> None:
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}},
                   what="reload_weights")  # fmt: skip

    def unload_adapter(self, name: str) -> None:
        try:  # absent the first time: its refusal is ignored
            self.http.request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        except PolicyServerError as error:
            raise PublishError(
                f"the policy server at {self.base_url} is unreachable (unload adapter): {error}"
            ) from error

    def load_adapter(self, name: str, directory: Path) -> None:
        self.unload_adapter(name)
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(directory)}, what="load adapter")

    def reset_prefix_cache(self, attempts: int = 20) -> None:
        for _ in range(attempts):
            answer = self._post("/reset_prefix_cache", what="reset_prefix_cache")
            if not isinstance(answer, dict) or answer.get("success", True):
                return
            time.sleep(0.25)  # running requests hold blocks
        raise PublishError("the policy server would not reset its prefix cache: calls could reuse old-weight KV")

    def set_version(self, version: int | str) -> None:
        self._post("/update_weight_version", {"new_version": str(version)}, what="update_weight_version")

    def pause(self, clear_cache: bool = True) -> None:
        """Stop computing: calls in flight are kept (not aborted), new ones queue until ``resume``. With
        ``clear_cache`` (vLLM 0.32 honours it with ``keep``, though its API calls it ignored) the engine also drops
        the prefix cache and preempts the calls in flight: they keep their tokens and recompute their KV after the
        resume, with the new weights. Without it a later ``/reset_prefix_cache`` fails while they hold blocks."""
        self._post(f"/pause?mode=keep&clear_cache={str(clear_cache).lower()}", what="pause")

    def resume(self) -> None:
        self._post("/resume", what="resume")

    def probe(self, model: str, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
        """The server's continuation of ``prompt`` (``steps`` ids sampled at temperature 1 with PROBE_SEED, end of
        sequence ignored) and each id's logprob: with nothing shaping the distribution, the weights' own, in either
        logprobs mode."""
        answer = self._post("/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": steps, "ignore_eos": True, "temperature": 1.0,
            "seed": PROBE_SEED, "logprobs": 0, "return_token_ids": True, "cache_salt": uuid.uuid4().hex,
        }, what="the probe")  # fmt: skip
        choice = answer["choices"][0]
        ids, values = choice.get("token_ids") or [], (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(ids) != steps or len(values) != steps or not all(isinstance(v, int | float) for v in values):
            raise PublishError(f"the probe came back with ids {ids[:steps + 2]} and logprobs {values[:steps + 2]}, "
                               f"not {steps} of each")  # fmt: skip
        return [int(i) for i in ids], [float(x) for x in values]


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / max(1, len(a))


LEFT_OUT = "left-out-v{version}"  # the version label of a replica a publish left out (no sidecar routes to it)
INSTANCE_ASKS = 8  # /server_info questions, each on a new connection, to tell one server from a load balancer


class PolicyReplicas:
    """Every policy replica a replica spec names: ``http://a:8000,http://b:8000`` or ``dns+http://NAME:PORT`` (a
    headless Service: every address NAME resolves to, resolved again at each publish), as the sidecar's --upstream.

    ``switch`` pauses all, loads and sets the version on each, resumes all; a replica that fails is left out.
    """

    def __init__(self, spec: str, timeout: float = 300.0, resolver: Resolver = resolve) -> None:
        try:
            self.upstreams = parse_upstreams(spec)
        except UpstreamError as error:
            raise ForgeError(str(error).replace("--upstream", "--policy-url")) from None
        self.spec = spec
        self.timeout = timeout
        self.resolver = resolver
        self.known: dict[str, PolicyClient] = {}
        self.last_split: dict[str, float] = {}  # the last switch's seconds: pause, load_reset, version, resume

    @property
    def base_url(self) -> str:
        return self.spec

    def clients(self) -> list[PolicyClient]:
        """The replicas now (dns+ names resolved again); a name that does not resolve fails in one line."""
        urls: list[str] = []
        for upstream in self.upstreams:
            if not upstream.dns:
                urls.append(upstream.url)
                continue
            try:
                addresses = self.resolver(upstream.host, upstream.port)
            except OSError as error:
                raise ForgeError(f"--policy-url {upstream.url}: {upstream.host} does not resolve ({error})") from None
            urls += [base_url(upstream.scheme, address, upstream.port) for address in addresses]
        if not urls:
            raise ForgeError(f"--policy-url {self.spec}: no replica listed (DNS gave no address)")
        for url in urls:
            if url not in self.known:
                self.known[url] = PolicyClient(url, self.timeout)
        return [self.known[url] for url in dict.fromkeys(urls)]

    def check(self) -> str:
        """The served model's name (every replica must serve the same), or a one-line error: a replica down, or a
        single URL behind which several servers answer (a load-balanced Service: a publish through it would reach
        one pod, and its pause and resume could land on different ones)."""
        clients = self.clients()
        names = {client.base_url: client.check() for client in clients}
        if len(set(names.values())) > 1:
            raise ForgeError(f"the policy replicas serve different models: {names}")
        for upstream in (u for u in self.upstreams if not u.dns):
            instances = instance_ids(upstream.url)
            if len(instances) > 1:
                raise ForgeError(
                    f"--policy-url {upstream.url} is load-balanced over several policy servers ({len(instances)} "
                    "answered): name every replica (comma-separated) or dns+http://HEADLESS-SERVICE:PORT"
                )
        return next(iter(names.values()))

    def each(self, clients: list[PolicyClient], work: Callable[[PolicyClient], Any]) -> dict[str, str]:
        """``work`` on every replica at once; returns what failed: URL -> why."""
        failed: dict[str, str] = {}
        with ThreadPoolExecutor(max(1, len(clients)), thread_name_prefix="forge-replica") as pool:
            futures = {client.base_url: pool.submit(work, client) for client in clients}
            for url, future in futures.items():
                try:
                    future.result()
                except (ForgeError, OSError, ValueError) as error:
                    failed[url] = str(error).splitlines()[0][:300]
        return failed

    def switch(
        self, clients: list[PolicyClient], load: Callable[[PolicyClient], None], version: int
    ) -> dict[str, str]:  # fmt: skip
        """Pause every replica, load each and reset its prefix cache, set the version on each that loaded, resume
        every one (also those that failed: none stays paused). Returns the replicas left out: URL -> why."""
        split = self.last_split = {}
        started = time.perf_counter()
        failed = self.each(clients, lambda c: c.pause())
        split["pause"] = time.perf_counter() - started
        try:
            ready = [c for c in clients if c.base_url not in failed]

            def load_and_reset(client: PolicyClient) -> None:
                load(client)
                client.reset_prefix_cache()

            started = time.perf_counter()
            failed |= self.each(ready, load_and_reset)
            split["load_reset"] = time.perf_counter() - started
            started = time.perf_counter()
            failed |= self.each([c for c in ready if c.base_url not in failed], lambda c: c.set_version(version))
            split["version"] = time.perf_counter() - started
        finally:
            started = time.perf_counter()
            resumed = self.each(clients, lambda c: c.resume())
            split["resume"] = time.perf_counter() - started
            for url, why in resumed.items():
                failed.setdefault(url, f"resume: {why}")
        return failed

    def leave_out(self, client: PolicyClient, version: int) -> None:
        """No sidecar routes to this replica any more: its version says it was left out, and matches no other's.
        Best effort: a replica that is down is left out already (and, back, serves an older version than the rest)."""
        with contextlib.suppress(ForgeError):
            client.set_version(LEFT_OUT.format(version=version))


def instance_ids(url: str, asks: int = INSTANCE_ASKS) -> set[str]:
    """The vLLM instance ids that answer at ``url`` over ``asks`` new connections (a load balancer spreads
    connections, not requests). Empty when the server does not say (no dev mode: then it cannot be published to
    anyway, which the publish says)."""
    found: set[str] = set()
    for _ in range(asks):
        http = PolicyServerClient(url, timeout=60)  # a new connection each time
        try:
            status, data = http.request("GET", "/server_info?config_format=json", headers={"connection": "close"})
            answer = json.loads(data) if status == 200 else None
            config = answer.get("vllm_config") if isinstance(answer, dict) else None
        except (PolicyServerError, ValueError):
            return found
        finally:
            http.close()
        if not isinstance(config, dict) or not config.get("instance_id"):
            return found
        found.add(str(config["instance_id"]))
    return found
