"""The statement backend builds model instances from its rows itself
(``PostgresBackend._from_db``): each JSON column is read by one decoder kept
for good, which must answer exactly what the field's own ``from_db_value``
answers, for every value a row can hold and for those it cannot."""

from __future__ import annotations

import json

import pytest

from batches.json_limits import MAX_JSON_DEPTH
from batches.models import BatchItem
from jobs.models import Job, Worker
from jobs.transitions.backends.postgres import _columns

DEEP = "[" * (MAX_JSON_DEPTH + 3) + "]" * (MAX_JSON_DEPTH + 3)
VALUES = [
    None,
    "{}",
    "[]",
    '{"gpu": "a100", "model": "m0"}',
    '{"text": "ok", "segments": [{"start": 0, "end": 1.5, "text": "hi"}]}',
    "1",
    '"a string"',
    "null",
    DEEP,
    "9" * 5000,  # more digits than Python converts: kept as its digits
    "not json",  # text that is not JSON stays text
    "\ufeff{}",  # json.loads refuses a byte order mark: stays text
    b'{"bytes": true}',
    bytearray(b"[1, 2]"),
]


@pytest.mark.parametrize("model", [Worker, Job, BatchItem])
@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_each_json_column_reads_as_its_field_does(model, value):
    fields = model._meta.concrete_fields
    readers = dict(_columns(model)[1])
    json_columns = [
        i for i, f in enumerate(fields) if f.get_internal_type() == "JSONField"
    ]
    assert json_columns and set(json_columns) <= set(readers)
    for i in json_columns:
        expected = fields[i].from_db_value(value, None, None)
        got = readers[i](value, None, None)
        assert got == expected
        assert type(got) is type(expected)
        # Twice: the kept decoder holds nothing over from one value to the next.
        assert readers[i](value, None, None) == expected


def test_deep_json_comes_back_flattened_and_huge_integers_as_digits():
    (i,) = [
        i
        for i, f in enumerate(Worker._meta.concrete_fields)
        if f.get_internal_type() == "JSONField"
    ]
    read = dict(_columns(Worker)[1])[i]
    deep = read(DEEP, None, None)
    depth = 0
    while isinstance(deep, list):
        (deep,) = deep or [None]
        depth += 1
    assert depth == MAX_JSON_DEPTH
    assert json.loads(deep) == [[[]]]
    assert read("9" * 5000, None, None) == "9" * 5000
