"""The stored Responses answers survive a restart (sidecar/response_store.py): written through to the WAL folder,
read back at start, with the same walls between episodes and the same bound."""

import sqlite3
import stat
from typing import Any

import pytest

from sidecar.response_store import DB_FILE, NotFound, ResponseStore, same_call


def answer(n: int) -> dict:
    return {"id": f"resp_{n}", "object": "response", "status": "completed",
            "output": [{"type": "message", "id": f"msg_{n}", "role": "assistant",
                        "content": [{"type": "output_text", "text": f"answer {n}"}]}]}  # fmt: skip


def asked(n: int) -> list:
    return [{"type": "message", "role": "user", "content": f"question {n}"}]


def continued(store: ResponseStore, episode: str, previous: str) -> list:
    body: dict[str, Any] = {"previous_response_id": previous, "input": [{"role": "user", "content": "and then?"}]}
    store.resolve(episode, body)
    return body["input"]


def test_a_restarted_store_resolves_what_the_old_one_kept(tmp_path):
    before = ResponseStore()
    assert before.persist(tmp_path) == 0
    before.keep("a", "call-1", asked(1), answer(1))
    before.keep("a", "call-2", asked(2), answer(2))
    before.keep("b", "call-3", asked(3), answer(3))
    before.delete("a", "resp_2")
    whole = continued(before, "a", "resp_1")
    before.close()
    assert stat.S_IMODE((tmp_path / DB_FILE).stat().st_mode) == 0o600

    after = ResponseStore()
    assert after.persist(tmp_path) == 2
    assert (
        continued(after, "a", "resp_1")
        == whole
        == [*asked(1), *answer(1)["output"], {"role": "user", "content": "and then?"}]
    )
    body = {"input": [{"type": "item_reference", "id": "msg_3"}]}
    after.resolve("b", body)
    assert body["input"] == answer(3)["output"]
    with pytest.raises(NotFound):  # deleted before the restart
        continued(after, "a", "resp_2")
    with pytest.raises(NotFound):  # another episode's, after the restart as before
        continued(after, "b", "resp_1")
    after.close()


def test_the_bound_holds_across_a_restart(tmp_path):
    before = ResponseStore(max_responses=2)
    before.persist(tmp_path)
    for n in range(4):
        before.keep("a", f"call-{n}", asked(n), answer(n))
    before.close()
    after = ResponseStore(max_responses=2)
    assert after.persist(tmp_path) == 2
    assert list(after.responses) == ["resp_2", "resp_3"]
    with pytest.raises(NotFound):
        continued(after, "a", "resp_1")


def test_without_a_folder_nothing_is_written(tmp_path):
    store = ResponseStore()
    store.keep("a", "call-1", asked(1), answer(1))
    store.close()
    assert not list(tmp_path.iterdir())


def test_a_row_that_cannot_be_read_back_is_skipped_and_the_rest_served(tmp_path):
    before = ResponseStore()
    before.persist(tmp_path)
    before.keep("a", "call-1", asked(1), answer(1))
    before.close()
    with sqlite3.connect(tmp_path / DB_FILE) as db:
        db.execute("INSERT INTO kept (response_id, episode, call_id, input, response) VALUES ('x', 'a', 'c', "
                   "'[not json', '{}')")  # fmt: skip
    after = ResponseStore()
    assert after.persist(tmp_path) == 1
    assert continued(after, "a", "resp_1")[: len(asked(1))] == asked(1)
    after.close()


def test_the_file_is_the_sidecars_own_whatever_was_there(tmp_path):
    (tmp_path / DB_FILE).touch(mode=0o644)
    (tmp_path / DB_FILE).chmod(0o644)
    ResponseStore().persist(tmp_path)
    for name in (DB_FILE, f"{DB_FILE}-wal", f"{DB_FILE}-shm"):
        if (tmp_path / name).exists():
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / DB_FILE).symlink_to(tmp_path / "elsewhere.sqlite")
    with pytest.raises(OSError):
        ResponseStore().persist(linked)
    assert not (tmp_path / "elsewhere.sqlite").exists()


def test_the_file_stays_within_its_byte_bound(tmp_path):
    store = ResponseStore(max_disk_bytes=2000)
    store.persist(tmp_path)
    for n in range(20):
        store.keep("a", f"call-{n}", asked(n) * 5, answer(n))
    store.close()
    with sqlite3.connect(tmp_path / DB_FILE) as db:
        (size,) = db.execute("SELECT SUM(length(input) + length(response)) FROM kept").fetchone()
        (count,) = db.execute("SELECT COUNT(*) FROM kept").fetchone()
    assert size <= 2000 and 0 < count < 20
    assert ResponseStore().persist(tmp_path) == count  # the newest ones


def test_a_tool_call_resent_by_value_continues_the_answer_that_made_it():
    """The Vercel AI SDK and the Agents SDK send the model's function call back by value (never as a reference):
    the same call id, name and arguments (serialized again) still name the answer that made it."""
    store = ResponseStore()
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}', "status": "completed"}  # fmt: skip
    store.keep("a", "call-1", asked(1), {"id": "resp_1", "output": [call]})
    resent = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    assert store.resolve("a", {"input": [*asked(1), resent, result]}) == "call-1"
    changed = {**resent, "arguments": '{"city":"Rome"}'}
    assert store.resolve("a", {"input": [*asked(1), changed, result]}) is None  # another call: a rewrite
    assert store.resolve("b", {"input": [*asked(1), resent, result]}) is None  # another episode's: nothing
    assert store.resolve("a", {"input": [*asked(2), resent, result]}) is None  # another history before it


def test_an_odd_call_id_or_deeply_nested_arguments_break_nothing():
    """Any JSON a client sends: a call id that is an object (kept with its item, then dropped) and arguments nested
    past the JSON parser's depth are compared, never raised on (a raise dropped another call's record)."""
    store = ResponseStore(max_responses=1)
    odd = {"type": "message", "role": "user", "content": "hi", "id": "m1", "call_id": {"x": 1}}
    store.keep("agent", "c1", [odd], {"id": "resp_1", "output": []})
    store.keep("other", "c2", [], {"id": "resp_2", "output": []})  # drops the first: no TypeError
    nested = "[" * 100_000
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": nested}
    assert same_call(call, dict(call)) and not same_call(call, {**call, "arguments": "[]"})
