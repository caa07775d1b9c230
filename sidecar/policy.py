"""Which model on a policy server is the policy under training, and its context: read from the server's model list.

The policy is one served name (``forge train`` prints it: ``forge-<run>`` with LoRA, the server's model with full
weights). A sidecar told it (``--policy-model``) serves every harness call by it; one not told takes the name the
server announces.
"""

from typing import Any


def announced_policy(listed: list[dict[str, Any]], current: str | None) -> str:
    """The policy a server announces in its model list: its only LoRA adapter (vLLM lists an adapter with its base as
    ``parent``), else its base model. An adapter once chosen stays while none or several are listed (a publish
    reloads it; another run's adapter may sit beside it): a LoRA run's calls never fall back to the base."""
    adapters = [m["id"] for m in listed if m.get("parent")]
    if len(adapters) == 1:
        return str(adapters[0])
    return current if current is not None else str(listed[0]["id"])


def policy_context(listed: list[dict[str, Any]], policy: str | None) -> int | None:
    """The policy's context (``max_model_len``): vLLM lists a LoRA adapter without one, its base model's is the
    adapter's (one server, one context)."""
    served = [m for m in listed if m.get("id") == policy]
    for card in (*served, *listed):
        context = card.get("max_model_len")
        if isinstance(context, int) and not isinstance(context, bool) and context > 0:
            return context
    return None
