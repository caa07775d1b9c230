"""mitmproxy's hook dispatch, planned once per hook instead of searched on every event.

mitmproxy's ``AddonManager.trigger_event`` walks every addon of the chain (mitmdump loads ~30) for every event of
every flow: per addon a context manager, a coroutine, a generator and a ``getattr``, although most addons implement
none of a flow's hooks. Profiled under the sidecar's load (64 clients), that walk was a third of the proxy's time
per call. ``plan_dispatch`` keeps, per hook name, the callables that walk would find — the same addons, in the same
order, each top-level addon's children under its own ``safecall`` as before, ``AddonHalt`` still stopping the
rest — and calls just those. The plan is dropped whenever the chain changes (``add``, ``register``, ``remove``,
``clear``: a script reloaded goes through ``remove`` and ``register``) and whenever options change (mitmproxy's
script loader reorders its scripts on a ``scripts`` change without either).

The rule this adds: an addon binds its hooks when it loads and never swaps a hook attribute afterwards (none of
mitmproxy's or ours does); an event already under way when the chain changes finishes on the plan it began with.
"""

import inspect
from collections.abc import Callable
from typing import Any

from mitmproxy import addonmanager, exceptions, hooks

Plan = tuple[tuple[Callable[..., Any], ...], ...]  # per top-level addon that implements the hook: its callables


def plan_dispatch(manager: addonmanager.AddonManager) -> None:
    """Make ``manager`` dispatch each hook to the callables planned for it (see the module's docstring)."""
    if getattr(manager, "forge_planned", False):
        return
    plans: dict[str, Plan] = {}
    searched = manager.trigger_event  # mitmproxy's own: for a hook whose plan cannot be made

    def dropping_plans(change: Callable[..., Any]) -> Callable[..., Any]:
        def changed(*args: Any, **kwargs: Any) -> Any:
            plans.clear()
            try:
                return change(*args, **kwargs)
            finally:
                plans.clear()

        return changed

    for name in ("add", "register", "remove", "clear"):
        setattr(manager, name, dropping_plans(getattr(manager, name)))

    def options_changed(updated: set[str]) -> None:
        plans.clear()

    manager.forge_options_changed = options_changed  # mitmproxy's signals hold their receivers weakly
    manager.master.options.changed.connect(options_changed)

    def plan(event: hooks.Hook) -> Plan:
        found = []
        for top in manager.chain:
            if callables := tuple(func for _, func in manager._iter_hooks(top, event)):
                found.append(callables)
        plans[event.name] = planned = tuple(found)
        return planned

    async def trigger_event(event: hooks.Hook) -> None:
        planned = plans.get(event.name)
        if planned is None:
            try:
                planned = plan(event)
            except Exception:  # e.g. an addon attribute named as a hook is not callable: mitmproxy's own logs it
                await searched(event)
                return
        if not planned:
            return
        args = event.args()
        for callables in planned:
            try:
                with addonmanager.safecall():
                    for func in callables:
                        result = func(*args)
                        if result is not None and inspect.isawaitable(result):
                            await result
            except exceptions.AddonHalt:
                return

    manager.trigger_event = trigger_event
    manager.forge_planned = True
