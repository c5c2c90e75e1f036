"""One msgpack codec for typed messages, shared by the data plane and the control plane.

A message type is a dataclass with a class attribute ``TAG`` (an int or a str, unique within its
plane). On the wire a message is one msgpack array ``[version, TAG, field 1, field 2, ...]`` in the
dataclass's field order; a nested dataclass is a nested array of its fields. Every field is checked
against its annotation both when encoding (a bad value fails in the sender: tensor-free messages
checked at the send, docs/ARCHITECTURE.md, The data plane) and when decoding (a receiver logs the
error naming the sender and drops the message). Every error names the message type and the field,
e.g. ``Ready.ring_slot: expected int, got str``.

Supported annotations: ``bool``, ``int`` (never a bool), ``float`` (an int is accepted and
converted), ``str``, ``bytes``, ``Any``, ``list`` / ``list[T]``, ``dict`` (string keys, any values) /
``dict[str, T]``, ``Optional[T]``, ``Union[...]`` and nested dataclasses. Any other annotation is a
bug found when the codec is built.

The same idea as vLLM V1's ``vllm/v1/serial_utils.py`` (msgspec structs with a type tag, no pickle),
written for plain dataclasses.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Iterable, Union

import msgpack

__all__ = ["MessageError", "Codec"]


class MessageError(ValueError):
    """A message that cannot be sent or accepted: undecodable, another version, an unknown type, a
    wrong number of fields, or a field whose value does not match its annotation."""


_Checker = Callable[[Any, str], Any]


def _type_label(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


class Codec:
    """Encoder and decoder of one plane's message types.

    Args:
        plane: the plane's name, used in error messages (``"data plane"``, ``"control plane"``).
        version: the plane's protocol version (bump on any change of a message's fields or meaning).
        types: the plane's message dataclasses, each with a unique ``TAG``.
        error: the exception class raised (a subclass of :class:`MessageError`).
        max_bytes: the largest frame :meth:`decode` accepts.

    Raises:
        TypeError: a type without ``TAG``, a duplicate tag, or an unsupported annotation.
    """

    def __init__(self, plane: str, version: int, types: Iterable[type], error: type = MessageError,
                 max_bytes: int = 1 << 20):
        self.plane = plane
        self.version = version
        self.error = error
        self.max_bytes = max_bytes
        self.by_tag: dict[Union[int, str], type] = {}
        self._fields: dict[type, list[tuple[str, _Checker]]] = {}
        for cls in types:
            tag = getattr(cls, "TAG", None)
            if not dataclasses.is_dataclass(cls) or tag is None:
                raise TypeError(f"{cls.__name__} is not a dataclass with a TAG")
            if tag in self.by_tag:
                raise TypeError(f"{cls.__name__} and {self.by_tag[tag].__name__} share the tag {tag!r}")
            self.by_tag[tag] = cls
            self._field_checkers(cls)

    # ------------------------------------------------------------------ checkers
    def _compile(self, tp: Any) -> _Checker:
        """A function ``check(value, where) -> value`` for one annotation."""
        err = self.error
        origin = typing.get_origin(tp)
        if origin is Union:
            args = typing.get_args(tp)
            optional = type(None) in args
            options = [self._compile(a) for a in args if a is not type(None)]
            label = _type_label(tp)

            def check_union(value: Any, where: str) -> Any:
                if value is None and optional:
                    return None
                for option in options:
                    try:
                        return option(value, where)
                    except MessageError:
                        continue
                raise err(f"{where}: expected {label}, got {type(value).__name__}")
            return check_union
        if dataclasses.is_dataclass(tp):
            self._field_checkers(tp)
            return lambda value, where: self._from_fields(tp, value, where)
        if origin is list or tp is list:
            (item_tp,) = typing.get_args(tp) or (Any,)
            item = None if item_tp is Any else self._compile(item_tp)

            def check_list(value: Any, where: str) -> Any:
                if not isinstance(value, list):
                    raise err(f"{where}: expected a list, got {type(value).__name__}")
                return value if item is None else [item(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return check_list
        if origin is dict or tp is dict:
            key_tp, value_tp = typing.get_args(tp) or (str, Any)
            if key_tp is not str:
                raise TypeError(f"unsupported annotation {tp}: map keys must be str")
            item = None if value_tp is Any else self._compile(value_tp)

            def check_map(value: Any, where: str) -> Any:
                if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                    raise err(f"{where}: expected a map with string keys, got {type(value).__name__}")
                return value if item is None else {k: item(v, f"{where}[{k!r}]") for k, v in value.items()}
            return check_map
        if tp is Any:
            return lambda value, where: value
        if tp is float:
            def check_float(value: Any, where: str) -> Any:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise err(f"{where}: expected float, got {type(value).__name__}")
                return float(value)
            return check_float
        if tp in (bool, int, str, bytes):
            def check_scalar(value: Any, where: str) -> Any:
                # bool is an int subclass: an int field never accepts True / False
                if isinstance(value, bool) is not (tp is bool) or not isinstance(value, tp):
                    raise err(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
                return value
            return check_scalar
        raise TypeError(f"unsupported annotation {tp}")

    def _field_checkers(self, cls: type) -> list[tuple[str, _Checker]]:
        checkers = self._fields.get(cls)
        if checkers is None:
            hints = typing.get_type_hints(cls)
            self._fields[cls] = checkers = []  # set first: a recursive type finds its own entry
            checkers.extend((f.name, self._compile(hints[f.name])) for f in dataclasses.fields(cls))
        return checkers

    def _from_fields(self, cls: type, values: Any, where: str) -> Any:
        checkers = self._fields[cls]
        if not isinstance(values, list) or len(values) != len(checkers):
            got = f"{len(values)} fields" if isinstance(values, list) else type(values).__name__
            raise self.error(f"{where}: expected {len(checkers)} fields, got {got}")
        return cls(**{name: check(v, f"{where}.{name}") for (name, check), v in zip(checkers, values)})

    def _to_fields(self, obj: Any) -> list:
        return [self._to_fields(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
                for v in (getattr(obj, name) for name, _ in self._fields[type(obj)])]

    # ------------------------------------------------------------------ wire
    def encode(self, msg: Any) -> bytes:
        """Serialise one message of this plane.

        Raises:
            MessageError (``self.error``): not a message type of this plane, a field whose value
                does not match its annotation (named ``Type.field``), or a value msgpack cannot
                carry (e.g. a tensor inside a map: tensors travel in ring slots, never in messages).
        """
        cls = type(msg)
        if self.by_tag.get(getattr(cls, "TAG", None)) is not cls:
            raise self.error(f"not a {self.plane} message: {cls.__name__}")
        fields = self._to_fields(msg)
        self._from_fields(cls, fields, cls.__name__)  # guard at the send
        try:
            return msgpack.packb([self.version, cls.TAG, *fields], use_bin_type=True)
        except (TypeError, ValueError, OverflowError):
            pass
        for (name, _), value in zip(self._fields[cls], fields):  # name the field msgpack refused
            try:
                msgpack.packb(value, use_bin_type=True)
            except (TypeError, ValueError, OverflowError) as exc:
                raise self.error(f"{cls.__name__}.{name}: cannot serialise ({exc}); it must hold plain msgpack "
                                 f"data (tensors travel in ring slots)") from None
        raise self.error(f"{cls.__name__}: cannot serialise")  # unreachable: some field failed above

    def decode(self, frame: bytes) -> Any:
        """Parse and check one message of this plane.

        Raises:
            MessageError (``self.error``): too large, not msgpack, not an array, another protocol
                version, an unknown type tag, a wrong number of fields, a field of the wrong type.
        """
        if len(frame) > self.max_bytes:
            raise self.error(f"{self.plane}: frame of {len(frame)} bytes exceeds {self.max_bytes}")
        try:
            obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # noqa: BLE001 - msgpack raises many unrelated types on garbage
            raise self.error(f"{self.plane}: undecodable frame of {len(frame)} bytes "
                             f"({type(exc).__name__}: {exc})") from None
        if not isinstance(obj, list) or len(obj) < 2:
            raise self.error(f"{self.plane}: expected [version, type, ...], got {type(obj).__name__}")
        version, tag = obj[0], obj[1]
        if version != self.version:
            raise self.error(f"{self.plane}: unsupported protocol version {version!r} (this side speaks "
                             f"{self.version})")
        cls = self.by_tag.get(tag) if isinstance(tag, (int, str)) and not isinstance(tag, bool) else None
        if cls is None:
            raise self.error(f"{self.plane}: unknown message type {tag!r}")
        return self._from_fields(cls, obj[2:], cls.__name__)
