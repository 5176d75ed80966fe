"""Reading a trace file: the JSON text, the format and version, every field checked.

Version 2 (written today) is version 1 (a flat ``steps`` list) plus one ``calls`` entry per
attention call (``layer``, ``meta``) and, in each step, the position of its ``call``. Both
are read by the same code, so a field has the same name in both (``steps[2].shape``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from qkv._read import FileLimitError, json_value, read_bytes
from qkv.trace._calls import CallInfo
from qkv.trace._check import (
    MAX_TRACE_BYTES,
    READ_VERSIONS,
    TRACE_FORMAT,
    TraceFileError,
    _expect,
    _meta,
    _optional_text,
    _required,
    _short,
    _token_count,
    _token_list,
)
from qkv.trace._step import Step

__all__ = ["parse_json", "read_parts", "read_text"]


def read_text(path: str | Path) -> str:
    """The text of a trace file, read with bounds (see :data:`MAX_TRACE_BYTES`).

    Raises:
        TraceFileError: not a regular file, too large, or not UTF-8 (without the file's
            name: the caller adds it).
        OSError: the file does not exist or cannot be read.
    """
    try:
        raw = read_bytes(os.fspath(path), limit=MAX_TRACE_BYTES, what="a trace file")
    except FileLimitError as error:
        raise TraceFileError(error.problem) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TraceFileError(
            f"not UTF-8 text (byte 0x{raw[error.start]:02x} at offset {error.start})"
        ) from None


def parse_json(text: str) -> Any:
    """The JSON value of a trace file's text.

    Raises:
        TraceFileError: not valid JSON, or nested too deeply.
    """
    try:
        return json_value(text)
    except json.JSONDecodeError as error:
        raise TraceFileError(
            f"not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})"
        ) from None
    except FileLimitError as error:
        raise TraceFileError(error.problem) from None


def read_parts(data: Any) -> tuple[dict[str, Any], list[CallInfo]]:
    """The fields of a trace (the keyword arguments of :class:`qkv.Trace`) and its call
    records, from :meth:`qkv.Trace.to_dict`'s form of version 1 or 2.

    Raises:
        TraceFileError: not a qkv trace, another version, or a field that is missing, of
            the wrong type or inconsistent; the message names the field.
    """
    data = _expect(data, Mapping, "", "a JSON object (a trace saved with Trace.save)")
    if data.get("format") != TRACE_FORMAT:
        raise TraceFileError(
            f"not a qkv trace: 'format' is {_short(data.get('format'))}, expected {TRACE_FORMAT!r}"
        )
    version = data.get("version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise TraceFileError(
            f"unsupported trace version {_short(version)}; this qkv reads versions "
            f"{' and '.join(map(str, READ_VERSIONS))}"
        )
    selection = _expect(data.get("selection") or {}, Mapping, "selection", "an object")

    def chosen(key: str, kinds: tuple[type, ...]) -> tuple[Any, ...] | None:
        value = selection.get(key)
        if value is None:
            return None
        items = _expect(value, list, f"selection.{key}", "a list")
        for i, item in enumerate(items):
            _expect(item, kinds, f"selection.{key}[{i}]", "a name or a whole number")
        return tuple(items)

    steps = _expect(_required(data, "steps", ""), list, "steps", "a list of steps")
    infos = _call_infos(data) if version == 2 else []
    read = [Step.from_dict(s, field=f"steps[{i}]") for i, s in enumerate(steps)]
    if version == 2:  # every step's call is one of 'calls' (none when 'calls' is empty)
        read = [
            replace(step, call=_call_of(raw, len(infos), f"steps[{i}]"))
            for i, (raw, step) in enumerate(zip(steps, read, strict=True))
        ]
    meta = _meta(data.get("meta"))
    _whole_head_counts(infos, read, meta)
    tokens = _token_list(data.get("tokens"), "tokens")
    _token_count(tokens, {s.value.shape[s.axes.index("key")] for s in read if "key" in s.axes})
    parts = {
        "steps": read,
        "tokens": tokens,
        "query_tokens": _token_list(data.get("query_tokens"), "query_tokens"),
        "meta": meta,
        "layers": chosen("layers", (str, int)),
        "heads": chosen("heads", (int,)),
        "queries": chosen("queries", (int,)),
        "record_steps": chosen("record_steps", (str,)),
    }
    return parts, infos


def _call_infos(data: Mapping[str, Any]) -> list[CallInfo]:
    """The ``calls`` of a version-2 file, each checked."""
    calls = _expect(_required(data, "calls", ""), list, "calls", "a list of calls")
    infos = []
    for i, raw in enumerate(calls):
        where = f"calls[{i}]"
        entry = _expect(raw, Mapping, where, "an object with layer and meta")
        infos.append(
            CallInfo(
                _optional_text(entry, "layer", where), _meta(entry.get("meta"), f"{where}.meta")
            )
        )
    return infos


def _whole_head_counts(infos: list[CallInfo], steps: list[Step], meta: dict[str, Any]) -> None:
    """Give each call of selected rows its own ``num_heads`` and ``num_kv_heads`` again.

    Files written before qkv kept a call's counts whole put the counts of the heads
    recomputed for the selected rows there (``num_kv_heads: 4`` for a model of 2), and every
    reader mapped query heads to the wrong key/value heads. Such a call still says which
    inputs it had (``shapes``, the whole call's): the counts are read from there, and the
    trace's own ``meta``, which repeated the last call's, follows.
    """
    with_heads = {s.call for s in steps if s.call is not None and {"head", "kv_head"} & set(s.axes)}
    for position, info in enumerate(infos):
        facts = info.meta
        shapes = facts.get("shapes")
        rows = facts.get("rows")  # a call of selected rows, recomputed beside a fast backend
        if position not in with_heads or not isinstance(rows, Mapping):
            continue
        if not isinstance(shapes, Mapping):
            continue
        query, key = shapes.get("query"), shapes.get("key")
        counts = [
            shape[-3]
            for shape in (query, key)
            if isinstance(shape, list) and len(shape) >= 3 and _count(shape[-3])
        ]
        if len(counts) != 2 or counts[0] % counts[1]:
            continue
        before = (facts.get("num_heads"), facts.get("num_kv_heads"))
        facts["num_heads"], facts["num_kv_heads"] = counts
        if (
            position == len(infos) - 1
            and (meta.get("num_heads"), meta.get("num_kv_heads")) == before
        ):
            meta["num_heads"], meta["num_kv_heads"] = counts


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _call_of(raw: Any, count: int, field: str) -> int | None:
    """A version-2 step's ``call``: the position of its call in ``calls``."""
    call = raw.get("call") if isinstance(raw, Mapping) else None
    if call is None:
        return None
    _expect(call, int, f"{field}.call", "a whole number (a position in 'calls')")
    if count == 0:
        raise TraceFileError(f"names call {call}, but 'calls' is empty", field=f"{field}.call")
    if not 0 <= call < count:
        raise TraceFileError(
            f"expected a position in 'calls', 0 to {count - 1}, got {call}", field=f"{field}.call"
        )
    return int(call)
