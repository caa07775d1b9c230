"""The injector's settings: what it adds to a pod (images, ports, the policy server, the store, secrets' names).

Read from the ConfigMap `openforge-injector` (key `settings.yaml`, mounted into the webhook's pod) or any YAML
file given to `forge inject render --settings`. Keys are the field names below; an unknown key or a value of the
wrong type is an error that names it (a typo must not silently fall back to a default).
"""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from forge.errors import ForgeError

# Labels and annotations, all under one prefix so a reader of a pod sees what OpenForge decided.
PREFIX = "openforge.io"
INJECT = f"{PREFIX}/inject"  # namespace label / pod annotation (or label): enabled | disabled
INJECTED = f"{PREFIX}/injected"  # set on an injected pod: the OpenForge version that injected it
SKIPPED = f"{PREFIX}/inject-skipped"  # set on a pod the webhook left alone: why
EPISODE = f"{PREFIX}/episode-id"
TASK = f"{PREFIX}/task-id"
RUN = f"{PREFIX}/run-id"
HARNESS = f"{PREFIX}/harness"  # the harness the pod runs: the sidecar labels every call with it
VERIFIER = f"{PREFIX}/verifier-container"  # the one container (besides the sidecar) given the reward credential


@dataclass(frozen=True)
class Resources:
    cpu_request: str = "100m"
    memory_request: str = "128Mi"
    cpu_limit: str = "2"
    memory_limit: str = "1Gi"

    def as_spec(self) -> dict[str, dict[str, str]]:
        return {
            "requests": {"cpu": self.cpu_request, "memory": self.memory_request},
            "limits": {"cpu": self.cpu_limit, "memory": self.memory_limit},
        }


@dataclass(frozen=True)
class InjectorSettings:
    """What the webhook injects. Defaults fit the kustomize base in k8s/ (namespace openforge-system)."""

    image: str = "openforge/sidecar:0.1.0"  # runs `forge net-init`, `forge ca init` and `forge sidecar`
    image_pull_policy: str = "IfNotPresent"
    proxy_uid: int = 1337
    proxy_port: int = 15001
    admin_port: int = 15002
    upstream: str = "dns+http://openforge-policy-replicas.openforge-system.svc:8000"  # every replica
    # The policy's served name, as `forge train` prints it (a LoRA run: forge-<run>); "": the one the server
    # announces (its only LoRA adapter, else its base model).
    policy_model: str = ""
    store: str = "s3://openforge/forge-data"
    s3_endpoint: str = ""
    model_hosts: str = "api.openai.com,api.anthropic.com"
    exclude_cidrs: tuple[str, ...] = ()  # never redirected (e.g. the cluster's service network for non-HTTP)
    store_secret: str = "openforge-store"  # AWS_* variables, for the sidecar only (optional Secret)
    ca_secret: str = "openforge-ca"  # the sidecar CA: tls.crt + tls.key (mounted into the CA init only)
    ca_bundle_configmap: str = "openforge-ca-bundle"  # ca-bundle.pem + mitmproxy-ca-cert.pem, for the apps
    # No longer made (rewards go on the sidecar's socket); a Secret of this name left by an earlier install must
    # still reach no app container: the injector refuses a pod that takes it.
    reward_token_secret: str = "openforge-reward-token"
    verifier_container: str = "verifier"  # default name of the verifier container (annotation overrides)
    sidecar_resources: Resources = field(default_factory=Resources)
    init_resources: Resources = field(default_factory=lambda: Resources("10m", "32Mi", "200m", "128Mi"))

    @classmethod
    def from_mapping(cls, data: Any, origin: str) -> "InjectorSettings":
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ForgeError(f"{origin}: the settings must be a YAML mapping of name: value")
        known = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, value in data.items():
            if name not in known:
                raise ForgeError(f"{origin}: unknown setting {name!r} (known: {', '.join(sorted(known))})")
            default = getattr(cls(), name)
            if isinstance(default, Resources):
                if not isinstance(value, dict) or set(value) - {f.name for f in dataclasses.fields(Resources)}:
                    raise ForgeError(f"{origin}: {name} takes cpu_request, memory_request, cpu_limit, memory_limit")
                values[name] = dataclasses.replace(default, **{k: str(v) for k, v in value.items()})
            elif isinstance(default, tuple):
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ForgeError(f"{origin}: {name} must be a list of strings")
                values[name] = tuple(value)
            elif isinstance(default, bool) or type(value) is not type(default):
                raise ForgeError(f"{origin}: {name} must be a {type(default).__name__}, not {value!r}")
            else:
                values[name] = value
        return cls(**values)

    @classmethod
    def load(cls, path: Path | None) -> "InjectorSettings":
        """The settings in a YAML file (a mounted ConfigMap key); the defaults when no file is named."""
        if path is None:
            return cls()
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as error:
            raise ForgeError(f"cannot read the settings {path}: {error.strerror}") from error
        except yaml.YAMLError as error:
            raise ForgeError(f"{path} is not YAML: {str(error).splitlines()[0]}") from error
        return cls.from_mapping(data, str(path))
