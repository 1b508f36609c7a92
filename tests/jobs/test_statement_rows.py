"""The statement backend builds model instances from its rows itself
(``PostgresBackend._from_db``): each JSON column is read by one decoder kept
for good, which must answer exactly what the field's own ``from_db_value``
answers, for every value a row can hold and for those it cannot; and each
instance is the one ``Model.from_db`` would build (``_loaded``), deferred
fields included."""

from __future__ import annotations

import json

import pytest
from django.db.models.signals import post_init

from batches.json_limits import MAX_JSON_DEPTH
from batches.models import Batch, BatchItem
from jobs.models import Job, Worker
from jobs.transitions.backends.postgres import _columns, _loaded, _plain

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


def _row(model, names):
    """A value for each of ``names`` that tells the fields apart."""
    return [f"{model.__name__}.{name}" for name in names]


def _built(instance):
    return (
        type(instance),
        {k: v for k, v in vars(instance).items() if k != "_state"},
        instance._state.adding,
        instance._state.db,
        instance.get_deferred_fields(),
    )


@pytest.mark.parametrize("model", [Job, BatchItem, Batch, Worker])
def test_an_instance_is_built_as_from_db_builds_it(model):
    assert _plain(model)
    names = [f.attname for f in model._meta.concrete_fields]
    for chosen in (names, names[:1], names[::2]):  # all fields; some deferred
        values = _row(model, chosen)
        loaded = _loaded(model, "default", chosen, values)
        assert _built(loaded) == _built(model.from_db("default", chosen, values))
        assert loaded._state.adding is False and loaded._state.db == "default"
        assert loaded.get_deferred_fields() == set(names) - set(chosen)


def test_a_model_init_signals_reach_still_goes_through_from_db():
    names = [f.attname for f in Job._meta.concrete_fields]
    seen = []

    def receiver(sender, instance, **kwargs):
        seen.append(instance)

    post_init.connect(receiver, sender=Job)
    try:
        job = _loaded(Job, "default", names, _row(Job, names))
    finally:
        post_init.disconnect(receiver, sender=Job)
    assert seen == [job]


@pytest.mark.django_db
def test_a_deferred_field_of_a_built_instance_is_read_from_the_database(batch):
    stored = Job.objects.order_by("pk").first()
    job = _loaded(Job, "default", ["id", "batch_id"], [stored.pk, stored.batch_id])
    assert job.get_deferred_fields() >= {"status", "item_id"}
    assert (job.status, job.item_id) == (stored.status, stored.item_id)
    assert job.batch == batch
