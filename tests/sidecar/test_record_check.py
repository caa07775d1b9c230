"""The record check compiled once per table (issue 24) coerces exactly as the column-by-column definition does."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.record import TABLES, _coerce, checked_row

ODD = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True),
    st.text(max_size=8), st.binary(max_size=9), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.one_of(st.floats(), st.integers(), st.text(max_size=3)), max_size=3),
)  # fmt: skip


def reference(table: str, row: dict) -> dict:
    """The definition: every column's value through ``_coerce`` for its type."""
    return {f.name: _coerce(row.get(f.name), f.type) for f in TABLES[table] if f.name != "schema_version"}


def same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(TABLES)), st.data())
def test_the_compiled_check_equals_the_column_by_column_coercion(table, data):
    names = [f.name for f in TABLES[table]] + ["not_a_column"]
    row = {name: data.draw(ODD, label=name) for name in data.draw(st.lists(st.sampled_from(names), unique=True))}
    checked, expected = checked_row(table, row), reference(table, row)
    assert checked.keys() == expected.keys()
    assert all(same(checked[k], expected[k]) for k in expected), (checked, expected)
