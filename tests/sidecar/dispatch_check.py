"""Run in the sidecar's environment (mitmproxy): the planned dispatch (``sidecar.dispatch``) against mitmproxy's own
on a real ``Master`` with mitmdump's default addons and test addons around them; prints "ok" when every hook reached
the same callables in the same order both ways. ``tests/sidecar/test_dispatch.py`` runs it."""

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mitmproxy import exceptions, hooks, http, master, options
from mitmproxy.addons import default_addons
from mitmproxy.proxy import layers
from mitmproxy.proxy.server_hooks import ServerConnectHook, ServerConnectionHookData
from mitmproxy.test import tflow

from sidecar.dispatch import plan_dispatch

calls: list[str] = []


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


async def main() -> None:
    searched, planned = await run(False), await run(True)
    assert searched == planned, f"mitmproxy's dispatch {searched}\nplanned dispatch {planned}"
    assert "after-halt.response" not in planned and "late.response" in planned, planned
    # One child's failure skips its later siblings (until the reorder puts the sibling first), not later addons.
    assert planned.count("sibling.request") == 1 and planned.count("after-fail.request") == 3, planned
    print("ok")


if __name__ == "__main__":
    asyncio.run(main())
