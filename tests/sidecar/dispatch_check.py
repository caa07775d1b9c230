"""Run in the sidecar's environment (mitmproxy): the planned dispatch (``sidecar.dispatch``) against mitmproxy's own
on a real ``Master`` with mitmdump's default addons and test addons around them; prints "ok" when every hook reached
the same callables in the same order both ways. ``tests/sidecar/test_dispatch.py`` runs it."""

import asyncio
import copy
import inspect
import io
import logging
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mitmproxy import exceptions, hooks, http, master, options
from mitmproxy.addons import default_addons
from mitmproxy.proxy import layers
from mitmproxy.proxy.server_hooks import ServerConnectHook, ServerConnectionHookData
from mitmproxy.test import tflow
from mitmproxy.tools import dump

from sidecar.dispatch import FLOW_HOOKS, INERT, plan_dispatch

calls: list[str] = []
SCRATCH = Path(tempfile.mkdtemp(prefix="forge-dispatch-"))


class Seen:
    """Records each hook it gets; ``halt`` names hooks it stops (AddonHalt), ``fail`` hooks it raises in."""

    def __init__(self, name: str, halt: tuple[str, ...] = (), fail: tuple[str, ...] = ()) -> None:
        self.name, self.halt, self.fail = name, halt, fail
        self.addons: list = []

    def _seen(self, hook: str) -> None:
        calls.append(f"{self.name}.{hook}")
        if hook in self.fail:
            raise ValueError(f"{self.name} fails in {hook}")
        if hook in self.halt:
            raise exceptions.AddonHalt

    def request(self, flow: http.HTTPFlow) -> None:
        self._seen("request")

    async def response(self, flow: http.HTTPFlow) -> None:
        await asyncio.sleep(0)
        self._seen("response")

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self._seen("requestheaders")

    def server_connect(self, data: ServerConnectionHookData) -> None:
        self._seen("server_connect")


class Parent(Seen):
    def __init__(self, name: str, *children: Seen, **kwargs) -> None:
        super().__init__(name, **kwargs)
        self.addons = list(children)


def events() -> list[hooks.Hook]:
    flow = tflow.tflow(resp=True)
    h = layers.http
    return [h.HttpRequestHeadersHook(flow), h.HttpRequestHook(flow), h.HttpResponseHook(flow),
            ServerConnectHook(ServerConnectionHookData(flow.server_conn, flow.client_conn)), h.HttpErrorHook(flow),
            hooks.UpdateHook([flow])]  # fmt: skip


async def run(planned: bool) -> list[str]:
    m = master.Master(options.Options(), event_loop=asyncio.get_running_loop())
    first, child = Seen("first"), Seen("child", fail=("request",))
    m.addons.add(first, *default_addons(), Parent("parent", child, Seen("sibling")), Seen("after-fail"))
    if planned:
        plan_dispatch(m.addons)
    calls.clear()
    for event in events():
        await m.addons.trigger_event(event)
    # The chain changes (an addon added, one removed): the next events reach what the chain holds now.
    m.addons.add(Seen("late", halt=("response",)), Seen("after-halt"))
    m.addons.remove(first)
    for event in events():
        await m.addons.trigger_event(event)
    # A child list reordered without register/remove (mitmproxy's script loader does so on a `scripts` option
    # change): the options change drops the plan.
    parent = next(a for a in m.addons.chain if getattr(a, "name", "") == "parent")
    parent.addons.reverse()
    m.options.update(listen_port=8181)
    for event in events():
        await m.addons.trigger_event(event)
    return list(calls)


class Errors(logging.Handler):
    """The addon errors mitmproxy logs (``safecall``'s "Addon error: ...")."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(f"{record.levelname} {record.getMessage()} {record.exc_info[0] if record.exc_info else ''}")


def flows(hook: str) -> list[http.HTTPFlow]:
    """Flows an inert hook must leave alone, at the hook's stage (a request hook's flow has no response yet): a plain
    call with credentials and a cache validator, one without, one to mitm.it (onboarding's host), one with cookies."""
    stage = {"resp": True} if hook.startswith("response") else {"err": True} if hook == "error" else {}
    authorized, plain, onboarding, cookies = (tflow.tflow(**stage) for _ in range(4))
    authorized.request.headers["authorization"] = "Bearer t"
    authorized.request.headers["if-none-match"] = '"v1"'
    onboarding.request.host = "mitm.it"
    onboarding.request.headers["host"] = "mitm.it"
    cookies.request.headers["cookie"] = "a=b"
    if cookies.response is not None:
        cookies.response.headers["set-cookie"] = "c=d; Path=/"
    return [authorized, plain, onboarding, cookies]


# Options that switch built-in addons on, one set at a time: under each, every rule of ``INERT`` that still holds must
# leave the flows alone (a rule that says "nothing to do" when there is something fails here).
ACTIVE: list[dict] = [
    {},
    {"modify_headers": ["/~q/x-a/1", "/~s/x-b/2"]},
    {"modify_body": ["/~q/content/changed", "/~s/message/x"]},
    {"map_remote": ["|address|other"]},
    {"anticache": True},
    {"anticomp": True},
    {"stickycookie": "~q"},
    {"stickyauth": "~q"},
    {"block_list": [":~q:403"]},
    {"onboarding": True},
    {"map_local": [f"|address|{__file__}"]},
    {"hardump": str(SCRATCH / "flows.har")},
    {"save_stream_file": str(SCRATCH / "flows")},
    {"flow_detail": 1},
]


HOOK_ORDER = ("requestheaders", "request", "responseheaders", "response", "error")  # a flow's hooks, in order


def effects(flow: http.HTTPFlow, addon: object) -> object:
    """What a hook could change: the flow, and the addon's own collections and output (saved flows, a HAR, lines)."""
    own = {k: len(v) for k, v in vars(addon).items() if isinstance(v, list | set | dict)}
    out = getattr(addon, "outfp", None)
    return copy.deepcopy(flow.get_state()), own, out.getvalue() if isinstance(out, io.StringIO) else None


async def inert_hooks_do_nothing() -> None:
    """Every hook ``INERT`` leaves out, run on its own under options where its rule holds: no flow changes. Checked
    to fail with a wrong rule (``ModifyHeaders`` always inert)."""
    checked = 0
    for active in ACTIVE:
        m = dump.DumpMaster(options.Options(), loop=asyncio.get_running_loop(), with_termlog=False)  # mitmdump's
        m.options.update(onboarding=False, flow_detail=0)
        m.options.update(**active)
        by_name = {f"{type(a).__module__}.{type(a).__qualname__}": a for a in m.addons.chain}
        by_name["mitmproxy.addons.dumper.Dumper"].outfp = io.StringIO()
        assert set(INERT) <= set(by_name), set(INERT) - set(by_name)  # every rule names an addon mitmdump loads
        for name in [name for name, rule in INERT.items() if rule(m.options)] * 2:  # the 2nd time with state
            for hook in HOOK_ORDER:
                if (func := getattr(by_name[name], hook, None)) is None:
                    continue
                for flow in flows(hook):
                    before = effects(flow, by_name[name])
                    result = func(flow)
                    if inspect.isawaitable(result):
                        await result
                    assert effects(flow, by_name[name]) == before, f"{name}.{hook} did something under {active}"
                    checked += 1
    assert checked >= 600 and set(FLOW_HOOKS) == set(HOOK_ORDER), checked


async def options_bring_an_addon_back() -> None:
    """Under the planned dispatch an addon's option set after the first events takes effect on the next one."""
    m = master.Master(options.Options(), event_loop=asyncio.get_running_loop())
    m.addons.add(*default_addons())
    plan_dispatch(m.addons)
    flow = tflow.tflow()
    await m.addons.trigger_event(layers.http.HttpRequestHeadersHook(flow))
    assert "x-forge" not in flow.request.headers
    m.options.update(modify_headers=["/~q/x-forge/on"])
    await m.addons.trigger_event(layers.http.HttpRequestHeadersHook(flow))
    assert flow.request.headers.get("x-forge") == "on", flow.request.headers


async def main() -> None:
    errors = Errors()
    logging.getLogger("mitmproxy.addonmanager").addHandler(errors)
    searched = await run(False)
    errors_searched, errors.seen = errors.seen, []
    planned = await run(True)
    assert searched == planned, f"mitmproxy's dispatch {searched}\nplanned dispatch {planned}"
    assert errors_searched == errors.seen and errors.seen, (errors_searched, errors.seen)  # the same errors logged
    try:
        await inert_hooks_do_nothing()
    finally:
        shutil.rmtree(SCRATCH)
    await options_bring_an_addon_back()
    assert "after-halt.response" not in planned and "late.response" in planned, planned
    # One child's failure skips its later siblings (until the reorder puts the sibling first), not later addons.
    assert planned.count("sibling.request") == 1 and planned.count("after-fail.request") == 3, planned
    print("ok")


if __name__ == "__main__":
    asyncio.run(main())
