"""Request texts as differences: any text is rebuilt exactly from any parent, and the index keeps a bounded few."""

from hypothesis import given
from hypothesis import strategies as st

from sidecar.request_delta import RequestIndex, common_prefix_chars, common_suffix_chars, delta

texts = st.text(alphabet=st.sampled_from(["a", "b", "{", '"', "é", "\U0001f600", "\ud800"]), max_size=60)


@given(texts, texts)
def test_any_text_is_rebuilt_exactly_from_any_parent(parent, text):
    d = delta("p", parent, text)
    assert d.apply(parent) == text
    assert d.prefix_chars + d.suffix_chars <= min(len(parent), len(text))
    assert d.prefix_chars == common_prefix_chars(parent, text)


@given(texts, texts, st.integers(0, 70))
def test_shared_ends_are_the_longest(a, b, limit):
    n = common_suffix_chars(a, b, limit)
    assert n <= limit and (n == 0 or a[-n:] == b[-n:])
    longer = n + 1
    assert longer > min(len(a), len(b), limit) or a[-longer:] != b[-longer:]


def test_the_closest_remembered_request_is_the_parent_and_little_sharing_is_stored_whole():
    index = RequestIndex(min_shared=10, calls_per_episode=2)
    base = '{"messages":["' + "m" * 40 + '"],"tools":["' + "t" * 40 + '"]}'
    index.remember("ep", "c1", base)
    grown = base.replace('"],"tools"', '","new turn"],"tools"')
    d = index.split("ep", grown)
    assert (d.parent_call_id, d.middle, d.apply(base)) == ("c1", ',"new turn"', grown)
    assert index.split("ep", "short").parent_call_id is None  # nothing worth a reference
    assert index.split("other", grown).parent_call_id is None  # another episode's requests are never parents
    index.remember("ep", "c2", grown)
    index.remember("ep", "c3", "x" * 100)
    assert [c for c, _ in index.recent.episodes["ep"]] == ["c2", "c3"] and index.recent.total == len(grown) + 100


def test_the_index_is_bounded_in_characters():
    index = RequestIndex(max_chars=250)
    for n in range(5):
        index.remember(f"ep{n}", "c", "x" * 100)
    assert index.recent.total <= 250 and list(index.recent.episodes) == ["ep3", "ep4"]
