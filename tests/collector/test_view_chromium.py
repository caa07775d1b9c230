"""`forge view`'s page opens in headless Chromium (Debian's chromium): a non-empty screenshot that shows the mask
colours, and a DOM with the episode, its calls, both segments and one span per token."""

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from forge.cli import cli

pytestmark = pytest.mark.integration

SAMPLED_GREEN = (0xB9, 0xF6, 0xCA)  # .gen in collector/view.py
CHROMIUM_TIMEOUT_S = 90


class Elements(HTMLParser):
    """Counts of elements by (tag, class) and the text of sampled-token spans."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []
        self.gen_texts: list[str] = []
        self._in_gen = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        self.found.append((tag, attributes))
        self._in_gen = tag == "span" and attributes.get("class") == "tok gen" and "title" in attributes
        if self._in_gen:
            self.gen_texts.append("")

    def handle_data(self, data: str) -> None:
        if self._in_gen:
            self.gen_texts[-1] += data

    def handle_endtag(self, tag: str) -> None:
        self._in_gen = False

    def count(self, tag: str, css: str | None = None, **attrs: str) -> int:
        return sum(
            1 for t, a in self.found
            if t == tag and (css is None or a.get("class") == css) and all(a.get(k) == v for k, v in attrs.items())
        )  # fmt: skip


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium")
    if binary is None:
        pytest.fail("Debian's chromium is not installed: apt-get install -y chromium (.ci/run does it)")
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.glob('chromium-profile-*')))}"
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", f"--user-data-dir={profile}", *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S, check=True)


def test_the_episode_page_opens_in_headless_chromium(synthetic_store, prepared_model, tmp_path):
    page = tmp_path / "compacted.html"
    result = CliRunner().invoke(cli, ["view", "compacted", "--store", synthetic_store.uri, "--html", str(page)])
    assert result.exit_code == 0 and "ids shown" not in result.output, result.output
    screenshot = tmp_path / "page.png"
    chromium(tmp_path, f"--screenshot={screenshot}", "--window-size=1200,2000", page.as_uri())
    image = Image.open(screenshot).convert("RGB")
    assert image.size == (1200, 2000)
    colours = {colour for _, colour in image.getcolors(maxcolors=1 << 20) or []}
    assert len(colours) > 20  # text, tables and tokens, not a blank page
    assert SAMPLED_GREEN in colours  # sampled tokens are painted

    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    elements = Elements()
    elements.feed(dom)
    episode = synthetic_store.episodes["compacted"]
    assert elements.count("h1", id="episode") == 1
    assert elements.count("td", id="status", css="status-complete") == 1
    assert elements.count("tr", "call") == len(episode.rows)
    assert elements.count("section", "segment") == 2
    assert elements.count("span", "call-boundary") == len(episode.rows) + 1  # one per call, one in the legend
    completions = [t for row in episode.rows for t in row["completion_token_ids"]]
    assert elements.count("span", "tok gen") == len(completions) + 1  # + the legend
    assert len(elements.gen_texts) == len(completions)
    assert not any(text.startswith("#") for text in elements.gen_texts)  # decoded by the model's tokenizer
