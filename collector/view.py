"""`forge view`: one episode as a self-contained HTML page (no script, no external file).

The page shows the episode's status and reward, its calls, and each segment's tokens coloured by the loss
mask (context grey, sampled green), with a marker where each call's new context and its completion begin.
Token text comes from the prepared model's tokenizer, for display only; without it, ids are shown.
"""

import html
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb

from collector.sql import UNKNOWN_LOGPROBS_SQL
from forge.errors import ForgeError
from forge.paths import default_model_root

Decoder = Callable[[list[int]], list[str]]

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: .5em 0 1em; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; }
.status-complete { color: #17692f; } .status-error { color: #b00020; }
.status-unfinished, .status-no_reward { color: #8a6100; }
.segment { border: 1px solid #999; border-radius: 4px; margin: 1em 0; padding: .5em; }
.tokens { font-family: ui-monospace, monospace; font-size: 12px; white-space: pre-wrap; word-break: break-all;
          line-height: 1.7; }
.tok { border-radius: 2px; }
.ctx { background: #eceff1; color: #555; }
.gen { background: #b9f6ca; color: #003d14; }
.unk { background: #ffe0b2; color: #6d3b00; outline: 1px dashed #e65100; }
.call-boundary { display: inline-block; background: #1a237e; color: #fff; font-size: 10px; padding: 0 3px;
                 margin: 0 2px; border-radius: 2px; }
.legend span { padding: 0 6px; margin-right: 8px; }
"""


def tokenizer_decoder(tokenizer_dir: Path | None = None) -> Decoder | None:
    """Per-token text from a tokenizer folder (default: the embedded model's), or None when there is none here.

    The viewer reads the tokenizer files only (no model, no trainer): any HF tokenizer folder of the served model.
    """
    folder = tokenizer_dir or default_model_root() / "bf16"
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging

        logging.set_verbosity_error()  # its notes about tokenizer options are not the user's concern here
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, ImportError) as error:
        if tokenizer_dir is not None:
            raise ForgeError(f"--tokenizer {tokenizer_dir}: no tokenizer there ({error})") from error
        return None

    def decode(ids: list[int]) -> list[str]:
        return tokenizer.batch_decode([[i] for i in ids])

    return decode


def _rows(con: duckdb.DuckDBPyConnection, query: str, params: list[Any]) -> list[dict[str, Any]]:
    return con.execute(query, params).arrow().read_all().to_pylist(maps_as_pydicts="lossy")


def render_episode(con: duckdb.DuckDBPyConnection, episode_id: str, decode: Decoder | None) -> str:
    episodes = _rows(con, "SELECT * FROM episodes WHERE episode_id = ?", [episode_id])
    if not episodes:
        raise ForgeError(f"no episode {episode_id!r} in the store: `forge episodes` lists them")
    episode = episodes[0]
    segments = _rows(con, "SELECT * FROM segments WHERE episode_id = ? ORDER BY segment", [episode_id])
    calls = _rows(
        con,
        "SELECT seq, call_id, status, finish_reason, policy_version, prompt_len, len(completion_token_ids) AS "
        f"completion_len, {UNKNOWN_LOGPROBS_SQL} AS unknown_logprobs, parent_call_id, prefix_len, error "
        "FROM calls_raw WHERE episode_id = ? ORDER BY seq",
        [episode_id],
    )
    esc = html.escape
    out = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>episode {esc(episode_id)}</title><style>{STYLE}</style></head><body>",
        f"<h1 id='episode' data-episode-id='{esc(episode_id)}'>Episode {esc(episode_id)}</h1>",
        "<table id='summary'>",
    ]
    for key in ("task_id", "run_id", "group_id", "harness", "status", "status_detail", "reward", "n_calls",
                "n_segments", "n_merged", "n_forked", "n_retries", "n_tokens", "n_trainable", "n_unknown_logprobs",
                "policy_version_min",
                "policy_version_max", "mixed_versions"):  # fmt: skip
        value = episode[key]
        css = f" class='status-{esc(str(value))}'" if key == "status" else ""
        out.append(f"<tr><th>{key}</th><td id='{key}'{css}>{esc(str(value))}</td></tr>")
    out.append("</table><h2>Calls</h2><table id='calls'><tr>")
    columns = list(calls[0]) if calls else []
    out.append("".join(f"<th>{esc(c)}</th>" for c in columns) + "</tr>")
    for call in calls:
        out.append(f"<tr class='call' data-call-id='{esc(call['call_id'])}'>")
        out.append("".join(f"<td>{esc('' if call[c] is None else str(call[c]))}</td>" for c in columns) + "</tr>")
    out.append("</table><h2>Segments</h2>")
    out.append("<p class='legend'><span class='tok ctx'>context (mask 0)</span>"
               "<span class='tok gen'>sampled (mask 1)</span>"
               "<span class='tok gen unk'>sampled, logprob unknown</span>"
               "<span class='call-boundary'>call</span></p>")  # fmt: skip
    for segment in segments:
        out.append(_segment_html(segment, decode))
    out.append("</body></html>")
    return "\n".join(out)


def _segment_html(segment: dict[str, Any], decode: Decoder | None) -> str:
    esc = html.escape
    ids, mask, logprobs = segment["input_ids"], segment["loss_mask"], segment["behaviour_logprobs"]
    texts = decode(ids) if decode else [f"#{i} " for i in ids]
    # A marker where each call's new context starts: the previous call's completion end (0 for the first call).
    marks: dict[int, str] = {}
    start = 0
    for call_id, seq, end, reward in zip(segment["call_ids"], segment["call_seqs"], segment["call_completion_ends"],
                                         segment["call_rewards"], strict=True):  # fmt: skip
        label = f"call {seq}" + (f" · reward {reward}" if reward is not None else "")
        marker = f"<span class='call-boundary' data-call-id='{esc(call_id)}'>▶ {esc(label)}</span>"
        marks[start] = marks.get(start, "") + marker
        start = end
    pieces = []
    for position, (token, text, trainable, logprob) in enumerate(zip(ids, texts, mask, logprobs, strict=True)):
        if position in marks:
            pieces.append(marks[position])
        if not trainable:
            pieces.append(f"<span class='tok ctx' title='{token}'>{esc(text)}</span>")
        elif math.isnan(logprob):  # sampled, but the upstream gave no logprob for it
            pieces.append(f"<span class='tok gen unk' title='{token} logprob unknown'>{esc(text)}</span>")
        else:
            pieces.append(f"<span class='tok gen' title='{token} logprob {logprob:.4f}'>{esc(text)}</span>")
    fork = f" from call {esc(segment['fork_call_id'])}" if segment["fork_call_id"] else ""
    return (
        f"<section class='segment' data-segment='{segment['segment']}' "
        f"data-fork-reason='{esc(segment['fork_reason'])}'>"
        f"<h3>Segment {segment['segment']}: {esc(segment['fork_reason'])}{fork}, shared prefix "
        f"{segment['shared_prefix_len']}, {segment['n_calls']} calls, {len(ids)} tokens, "
        f"{segment['n_trainable']} trainable, {segment['n_unknown_logprobs']} without logprob</h3>"
        f"<div class='tokens'>{''.join(pieces)}</div></section>"
    )
