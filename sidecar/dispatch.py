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

Two more savings, measured per call under one client (``bench/sidecar_latency.py``):

- A built-in addon whose options leave a flow hook with nothing to do is left out of that hook's plan (``INERT``:
  e.g. ``MapLocal`` with no ``map_local`` rule reads every request's URL and matches it against no rule). Each rule
  names the option that switches the addon on and is read from mitmproxy's own code (11.0); plans are made again
  whenever an option changes, so setting one puts its addon back at once. Only flow hooks are ever left out:
  ``load``, ``configure``, ``running`` and ``done`` always reach every addon.
- ``safecall``'s behaviour (an addon's error logged, ``AddonHalt`` and ``OptionsError`` passed on) without its
  context manager, a generator per addon per event.
"""

import inspect
import logging
from collections.abc import Callable
from typing import Any

from mitmproxy import addonmanager, exceptions, hooks, options

Plan = tuple[tuple[Callable[..., Any], ...], ...]  # per top-level addon that implements the hook: its callables

FLOW_HOOKS = frozenset({"requestheaders", "request", "responseheaders", "response", "error"})
# A built-in addon (by class) that does nothing in a flow hook while this holds of the options (mitmproxy 11.0's
# code: each returns at once, or loops over no rule, or writes to no file). tests/sidecar/dispatch_check.py runs
# every such hook on flows under these options and finds each flow unchanged.
INERT: dict[str, Callable[[options.Options], bool]] = {
    "mitmproxy.addons.onboarding.Onboarding": lambda o: not o.onboarding,
    "mitmproxy.addons.maplocal.MapLocal": lambda o: not o.map_local,
    "mitmproxy.addons.mapremote.MapRemote": lambda o: not o.map_remote,
    "mitmproxy.addons.modifyheaders.ModifyHeaders": lambda o: not o.modify_headers,
    "mitmproxy.addons.modifybody.ModifyBody": lambda o: not o.modify_body,
    "mitmproxy.addons.anticache.AntiCache": lambda o: not o.anticache,
    "mitmproxy.addons.anticomp.AntiComp": lambda o: not o.anticomp,
    "mitmproxy.addons.savehar.SaveHar": lambda o: not o.hardump,
    "mitmproxy.addons.save.Save": lambda o: not o.save_stream_file,
    "mitmproxy.addons.dumper.Dumper": lambda o: o.flow_detail == 0,
    "mitmproxy.addons.stickycookie.StickyCookie": lambda o: not o.stickycookie,
    "mitmproxy.addons.stickyauth.StickyAuth": lambda o: not o.stickyauth,
    "mitmproxy.addons.blocklist.BlockList": lambda o: not o.block_list,
}


def inert(addon: Any, hook: str, opts: options.Options) -> bool:
    """Whether ``addon``'s ``hook`` has nothing to do under ``opts`` (see ``INERT``)."""
    if hook not in FLOW_HOOKS:
        return False
    rule = INERT.get(f"{type(addon).__module__}.{type(addon).__qualname__}")
    try:
        return rule is not None and bool(rule(opts))
    except AttributeError:  # an option this mitmproxy does not have: the addon is not the one the rule knows
        return False


def addon_error(error: Exception) -> None:
    """What mitmproxy's ``safecall`` does with an addon's error: logged with the addon's part of the traceback."""
    tb = addonmanager.cut_traceback(error.__traceback__, "invoke_addon_sync")
    tb = addonmanager.cut_traceback(tb, "invoke_addon")
    logging.getLogger(addonmanager.__name__).error(f"Addon error: {error}", exc_info=(type(error), error, tb))


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
        opts = manager.master.options
        for top in manager.chain:
            if callables := tuple(
                func for addon, func in manager._iter_hooks(top, event) if not inert(addon, event.name, opts)
            ):
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
                for func in callables:
                    result = func(*args)
                    if result is not None and inspect.isawaitable(result):
                        await result
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception as error:  # as mitmproxy's safecall: logged, the next top-level addon goes on
                addon_error(error)

    manager.trigger_event = trigger_event
    manager.forge_planned = True
