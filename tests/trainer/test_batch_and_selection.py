"""Rows, advantages and episode selection on the collector's real output (synthetic stores, no model)."""

import math
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from bench.collector_generate import SyntheticEpisode, write_calls, write_rewards
from collector.collect import Collector, trainable
from forge.errors import ForgeError
from trainer.batch import episode_advantages, padded, rows_from_segments
from trainer.loop import NothingReady, Trainer, TrainSettings, TrainState, select_groups, update_inputs


def store_of(path: Path, episodes: list[tuple[str, str, str, float]], nan_last: bool = False, run: str = "r") -> Path:
    """(episode id, task id, policy version, reward): two calls each, the second extending the first."""
    rows = []
    for n, (episode_id, task, version, _) in enumerate(episodes):
        episode = SyntheticEpisode(episode_id, task_id=task, run_id=run, policy_version=version)
        prompt = list(range(100 + n, 110 + n))
        first = list(range(2000 + 10 * n, 2004 + 10 * n))
        episode.call(prompt, first)
        second = list(range(3000 + 10 * n, 3003 + 10 * n))
        logprobs = [-0.5, -0.25, math.nan if nan_last else -0.125]
        episode.call(prompt + first + [7, 8], second, logprobs=logprobs)
        rows += episode.rows
    write_calls(str(path), rows, name="calls-0", run=run)
    write_rewards(str(path), [{"episode_id": e, "reward": r} for e, _, _, r in episodes], run=run)
    return path


def collected(path: Path) -> pa.Table:
    return Collector(str(path), progress=False).update()


def waiting_trainer(store: Path, state: TrainState | None = None) -> Trainer:
    """A trainer with only what its wait for episodes needs (no policy server, no engine)."""
    trainer = Trainer.__new__(Trainer)
    trainer.settings = TrainSettings(store=str(store), policy_url="http://127.0.0.1:9", idle_seconds=0.0)
    trainer.state = state or TrainState()
    trainer.collector = Collector(str(store), idle_seconds=0.0, progress=False)
    return trainer


def test_a_segment_becomes_one_row_token_exact(tmp_path):
    store = store_of(tmp_path, [("a", "t", "0", 1.0), ("b", "t", "0", 0.0)])
    segments = trainable(collected(store).segments)
    batch = rows_from_segments(segments)
    assert len(batch) == 2
    for row, seg in zip(batch.rows, segments.to_pylist(), strict=True):
        assert row.prompt + row.response == seg["input_ids"]  # the recorded ids, never re-tokenized
        first = seg["loss_mask"].index(1)
        assert len(row.prompt) == first and row.response_mask == seg["loss_mask"][first:]
        # The second call's new context [7, 8] sits inside the response, masked out.
        assert row.response_mask == [1, 1, 1, 1, 0, 0, 1, 1, 1]
        assert row.rollout_log_probs[-3:] == [-0.5, -0.25, -0.125]
    tensors = padded(batch.rows)
    assert tensors["response_mask"].sum() == 14 and tensors["input_ids"].shape[1] == 10 + 9


def test_advantages_come_from_verl_by_name_per_episode_and_group(tmp_path):
    store = store_of(tmp_path, [("a", "t", "0", 1.0), ("b", "t", "0", 0.0), ("c", "u", "0", 5.0)])
    rows = rows_from_segments(trainable(collected(store).segments)).episodes
    grpo = episode_advantages(rows, "grpo")
    assert grpo["a"] == pytest.approx(-grpo["b"]) and grpo["a"] > 0
    assert grpo["c"] == pytest.approx(5.0)  # veRL's GRPO: a group of one keeps its raw score (mean 0, std 1)
    rloo = episode_advantages(rows, "rloo")
    assert rloo["a"] == pytest.approx(1.0) and rloo["b"] == pytest.approx(-1.0)
    with pytest.raises(ForgeError, match="unknown --algo"):
        episode_advantages(rows, "no-such-estimator")


def test_unknown_behaviour_logprobs_take_the_trainers_own_and_never_reach_the_loss_as_nan(tmp_path):
    store = store_of(tmp_path, [("a", "t", "0", 1.0), ("b", "t", "0", 0.0)], nan_last=True)
    batch = rows_from_segments(trainable(collected(store).segments))
    assert sum(r.n_unknown for r in batch.rows) == 2
    asked = []

    def trainer_logprobs(tensors):
        asked.append(1)
        return torch.full(tensors["responses"].shape, -3.0), torch.zeros(tensors["responses"].shape)

    for correction in ("bypass", "decoupled"):
        tensors, metrics = update_inputs(
            batch, episode_advantages(batch.episodes, "grpo"), correction, "token", 2.0, trainer_logprobs
        )
        mask = tensors["response_mask"].bool()
        assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())
        assert int(metrics["_unknown"].sum()) == 2
        assert (tensors["old_log_probs"][metrics["_unknown"]] == -3.0).all()
        assert tensors["response_mask"].sum() == 14  # still trained: a tool call or an end of turn matters
        if correction == "decoupled":
            weights = tensors["rollout_is_weights"][mask]
            assert weights.max() <= 2.0 and (weights[metrics["_unknown"][mask]] == 1.0).all()
    assert len(asked) == 2


def test_bypass_without_unknowns_never_recomputes_so_async_k0_feeds_veRL_what_sync_does(tmp_path):
    store = store_of(tmp_path, [("a", "t", "0", 1.0), ("b", "t", "0", 0.0)])
    episodes = collected(store).episodes
    sync, _, _ = select_groups(episodes, 0, "sync", 0, set(), 2)
    async0, _, _ = select_groups(episodes, 0, "async", 0, set(), 2)
    assert sync == async0 == ["a", "b"]
    batch = rows_from_segments(trainable(collected(store).segments))

    def never(tensors):
        raise AssertionError("bypass on known logprobs must not recompute")

    first, _ = update_inputs(batch, episode_advantages(batch.episodes, "grpo"), "bypass", None, 2.0, never)
    second, _ = update_inputs(batch, episode_advantages(batch.episodes, "grpo"), "bypass", None, 2.0, never)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_near_on_policy_selection_ages_out_groups_whole_and_never_repeats_an_episode(tmp_path):
    store = store_of(tmp_path, [
        ("old-1", "t", "1", 1.0), ("old-2", "t", "1", 0.0),  # group r/t/v1
        ("mid-1", "t", "3", 1.0), ("mid-2", "t", "3", 0.0),  # group r/t/v3
        ("new-1", "u", "4", 1.0), ("new-2", "u", "4", 0.0),  # group r/u/v4
    ])  # fmt: skip
    episodes = collected(store).episodes
    chosen, aged, waiting = select_groups(episodes, 4, "async", 2, set(), 10)
    assert sorted(chosen) == ["mid-1", "mid-2", "new-1", "new-2"]
    assert sorted(aged) == ["old-1", "old-2"] and waiting["aged_out"] == 2
    chosen, _, _ = select_groups(episodes, 4, "sync", 0, set(), 10)
    assert sorted(chosen) == ["new-1", "new-2"]
    chosen, _, _ = select_groups(episodes, 4, "async", 2, {"mid-1", "mid-2"}, 10)
    assert sorted(chosen) == ["new-1", "new-2"]
    # A group is never split: one episode of v3 served partly by v1 takes its whole group out.
    mixed = episodes.to_pylist()
    for row in mixed:
        if row["episode_id"] == "mid-2":
            row["policy_version_min"] = "1"
    chosen, aged, _ = select_groups(pa.Table.from_pylist(mixed, schema=episodes.schema), 4, "async", 2, set(), 10)
    assert sorted(chosen) == ["new-1", "new-2"] and sorted(aged) == ["mid-1", "mid-2", "old-1", "old-2"]


def test_a_trainer_never_selects_an_evaluations_episodes(tmp_path):
    """`forge eval` runs are named eval-…: their complete, rewarded groups of the current version sit in the store
    beside a training run's, and the trainer's selection leaves them out, counted, in both modes."""
    store = store_of(tmp_path, [("train-a", "t", "0", 1.0), ("train-b", "t", "0", 0.0)])
    store_of(tmp_path, [("eval-1.t.0", "t", "0", 1.0), ("eval-1.t.1", "t", "0", 0.0),
                        ("eval-1.u.0", "u", "0", 0.5), ("eval-1.u.1", "u", "0", 1.0)], run="eval-1")  # fmt: skip
    episodes = collected(store).episodes
    assert sorted(episodes["run_id"].to_pylist()) == ["eval-1"] * 4 + ["r"] * 2
    for mode, staleness in (("sync", 0), ("async", 3)):
        chosen, aged, waiting = select_groups(episodes, 0, mode, staleness, set(), 100)
        assert sorted(chosen) == ["train-a", "train-b"] and aged == []
        assert waiting["for_evaluation"] == 4

    # The trainer's own wait (no policy server needed for it): the training group, never the evaluation's.
    trainer = waiting_trainer(store)
    _, chosen, _, _, _ = trainer.wait_for_episodes(every_ready=True)
    assert sorted(chosen) == ["train-a", "train-b"]
    trainer.state = TrainState(trained=chosen)  # once trained, only the evaluation's remain: nothing to train on
    with pytest.raises(NothingReady, match="4 for evaluation"):
        trainer.wait_for_episodes(every_ready=True)


def test_an_episode_whose_weights_are_unknown_is_never_trained_and_says_why(tmp_path):
    """A call served by another model than the policy (the base during a LoRA run) or whose version question
    failed is recorded with no version: its episode is not on-policy for any version, so it is left out (counted
    as version_unknown) while the rest of its group trains."""
    rows = []
    for n, (episode_id, version) in enumerate([("known-1", "0"), ("known-2", "0"), ("unknown", None)]):
        episode = SyntheticEpisode(episode_id, task_id="t", run_id="r")
        prompt = list(range(100 + n, 110 + n))
        episode.call(prompt, [2000 + n, 2001])
        rows += episode.rows
        if version is None:
            rows[-1]["policy_version"] = None
    write_calls(str(tmp_path), rows, name="calls-0", run="r")
    write_rewards(str(tmp_path), [{"episode_id": e, "reward": r} for e, r in
                                  [("known-1", 1.0), ("known-2", 0.0), ("unknown", 1.0)]], run="r")  # fmt: skip
    episodes = collected(tmp_path).episodes
    counts = dict(zip(episodes["episode_id"].to_pylist(), episodes["n_version_unknown"].to_pylist(), strict=True))
    assert counts == {"known-1": 0, "known-2": 0, "unknown": 1}
    chosen, aged, waiting = select_groups(episodes, 0, "sync", 0, set(), 10)
    assert sorted(chosen) == ["known-1", "known-2"] and not aged and waiting["version_unknown"] == 1


def test_an_episode_the_trainer_does_not_select_still_counts_in_its_groups_baseline(tmp_path):
    """An agent that fails its task could also break a call (an error record) or make every call of its episode
    unknown-versioned: the episode is then never selected, and before, its group's baseline was its siblings'
    alone: the failure got no negative advantage and the winners a smaller positive one (a: +0.707 with b's 0.0
    alone). Its reward counts all the same; it is never trained (nothing of it enters the update)."""
    rows = []
    for n, (episode_id, how) in enumerate([("a", "ok"), ("b", "ok"), ("broke", "error"), ("hid", "unknown")]):
        episode = SyntheticEpisode(episode_id, task_id="t", run_id="r")
        episode.call(list(range(100 + n, 110 + n)), [2000 + n, 2001])
        if how == "error":
            episode.call([*range(100 + n, 110 + n), 2000 + n, 2001, 7], None, status="error", error="HTTP 400")
        elif how == "unknown":
            episode.rows[-1]["policy_version"] = None
        rows += episode.rows
    write_calls(str(tmp_path), rows, name="calls-0", run="r")
    rewards = {"a": 1.0, "b": 0.0, "broke": 0.0, "hid": 0.0}
    write_rewards(str(tmp_path), [{"episode_id": e, "reward": r} for e, r in rewards.items()], run="r")
    trainer = waiting_trainer(tmp_path)
    segments, chosen, _, _, mates = trainer.wait_for_episodes(every_ready=True)
    assert sorted(chosen) == ["a", "b"]
    assert mates == {"broke": ("r/t/v0", 0.0), "hid": ("r/t/v0", 0.0)}  # "hid" has no version: its run and task
    batch = rows_from_segments(segments, mates)
    assert batch.episode_ids == ["a", "b"]  # trained: the selected only
    advantage = episode_advantages(batch.episodes, "grpo")
    # GRPO over (1, 0, 0, 0): mean 1/4, sd (unbiased) 1/2
    assert advantage["a"] == pytest.approx(1.5, abs=1e-4) and advantage["b"] == pytest.approx(-0.5, abs=1e-4)
    # Consumed with the step that counted them (as Trainer.step does): "hid" would otherwise join every later group
    # of its run and task.
    later = []
    for n, episode_id in enumerate(["c", "d"]):
        episode = SyntheticEpisode(episode_id, task_id="t", run_id="r", policy_version="1")
        episode.call(list(range(300 + n, 310 + n)), [4000 + n, 4001])
        later += episode.rows
    write_calls(str(tmp_path), later, name="calls-1", run="r")
    write_rewards(str(tmp_path), [{"episode_id": "c", "reward": 1.0}, {"episode_id": "d", "reward": 0.0}],
                  name="rewards-1", run="r")  # fmt: skip
    trainer.state = TrainState(version=1, trained=chosen, skipped=sorted(mates))
    _, chosen, _, _, mates = trainer.wait_for_episodes(every_ready=True)
    assert sorted(chosen) == ["c", "d"] and mates == {}


def test_a_segment_sampled_otherwise_than_at_a_plain_temperature_is_left_out_counted():
    from bench.collector_generate import SyntheticEpisode
    from collector.assemble import assemble
    from sidecar.record import to_table
    from trainer.batch import padded, rows_from_segments

    rows = []
    for name, sampling in [("warm", '{"temperature": 0.7}'), ("nucleus", '{"temperature": 0.7, "top_p": 0.5}')]:
        episode = SyntheticEpisode(name)
        episode.call(list(range(100, 140)), list(range(5000, 5008)))
        episode.rows[-1]["sampling"] = sampling
        rows += episode.rows
    rewards = [{"episode_id": e, "reward": 1.0} for e in ("warm", "nucleus")]
    segments, _ = assemble(to_table(rows, "calls"), to_table(rewards, "rewards"))
    batch = rows_from_segments(segments)
    assert [r.episode_id for r in batch.rows] == ["warm"] and batch.skipped == {"sampling_not_modelled": 1}
    assert padded(batch.rows)["temperature"].tolist() == [0.699999988079071]  # per row, to veRL


def batch_of(episodes: list[tuple[str, str, float, str]]):
    """(episode id, task id, reward, sampling JSON): one call each, assembled by the collector → the trainer's batch."""
    from bench.collector_generate import SyntheticEpisode
    from collector.assemble import assemble
    from sidecar.record import to_table

    rows = []
    for n, (name, task, _, sampling) in enumerate(episodes):
        episode = SyntheticEpisode(name, task_id=task)
        episode.call(list(range(100 + n, 140 + n)), list(range(5000 + 10 * n, 5008 + 10 * n)))
        episode.rows[-1]["sampling"] = sampling
        rows += episode.rows
    rewards = [{"episode_id": e, "reward": r} for e, _, r, _ in episodes]
    segments, _ = assemble(to_table(rows, "calls"), to_table(rewards, "rewards"))
    return rows_from_segments(segments)


def test_an_episode_left_out_still_counts_in_its_groups_baseline():
    """The agent cannot pick its group's baseline by making one of its episodes untrainable (an unmodelled sampling
    parameter): that episode's reward still counts. Before: the baseline was the trainable episodes' alone
    (a: +0.707, b: −0.707, as if c had never run)."""
    batch = batch_of([("a", "t", 1.0, '{"temperature": 0.8}'), ("b", "t", 0.0, '{"temperature": 0.8}'),
                      ("c", "t", 0.0, '{"temperature": 0.8, "top_p": 0.5}')])  # fmt: skip
    assert batch.episode_ids == ["a", "b"] and batch.skipped == {"sampling_not_modelled": 1}
    advantage = episode_advantages(batch.episodes, "grpo")
    # GRPO over rewards (1, 0, 0): mean 1/3, sd (unbiased) 1/√3
    assert advantage["a"] == pytest.approx((1 - 1 / 3) * math.sqrt(3), abs=1e-4)
    assert advantage["b"] == pytest.approx(-(1 / 3) * math.sqrt(3), abs=1e-4)


def test_a_group_whose_rewards_are_all_equal_is_left_out_of_the_update_counted():
    plain = '{"temperature": 0.8}'
    batch = batch_of([("a", "t", 1.0, plain), ("b", "t", 0.0, plain), ("c", "u", 0.5, plain), ("d", "u", 0.5, plain),
                      ("e", "v", 0.5, plain)])  # fmt: skip
    assert batch.flat_groups == {"run-1/u/v0"}  # "v" is a group of one: veRL's GRPO gives it its raw score, it stays
    assert batch.leave_out_flat_groups() == 1
    assert batch.episode_ids == ["a", "b", "e"] and batch.skipped == {"zero_variance_group": 2}
    # Eight equal rewards of 0.4: veRL's GRPO makes float noise of them (advantages up to ±0.06); still left out.
    batch = batch_of([(f"x{i}", "w", 0.4, plain) for i in range(8)])
    assert max(abs(a) for a in episode_advantages(batch.episodes, "grpo").values()) > 0.01
    assert batch.leave_out_flat_groups() == 1 and not batch.rows


def test_a_step_with_nothing_to_learn_consumes_its_episodes_without_an_update(tmp_path, monkeypatch):
    from trainer.loop import NothingToLearn

    store = store_of(tmp_path / "store", [("a", "t", "0", 0.5), ("b", "t", "0", 0.5)])
    trainer = Trainer.__new__(Trainer)  # no policy server or engine: nothing may reach them
    trainer.settings = TrainSettings(store=str(store), policy_url="http://127.0.0.1:9", idle_seconds=0.0)
    trainer.state, trainer.state_dir = TrainState(), tmp_path / "state"
    trainer.state_dir.mkdir()
    trainer.collector = Collector(str(store), idle_seconds=0.0, progress=False)
    monkeypatch.setattr(Trainer, "engine", property(lambda self: pytest.fail("no update when nothing is learnable")))
    with pytest.raises(NothingToLearn, match="2 segments zero variance group"):
        trainer.step(every_ready=True)
    state = TrainState(**__import__("json").loads((tmp_path / "state" / "state.json").read_text()))
    assert state.step == 0 and state.version == 0 and sorted(state.skipped) == ["a", "b"] and not state.trained
    with pytest.raises(NothingReady):  # consumed: not offered again
        trainer.step(every_ready=True)
