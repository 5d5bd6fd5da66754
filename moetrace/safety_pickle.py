"""Reading a pickle that may be hostile: plain containers and scalars only, nothing else.

PyTorch's Flight Recorder writes its dumps as pickles (protocol 2, from C++: dicts, lists,
tuples, strings, numbers, booleans and None). A pickle can also import any name and call
it (``GLOBAL`` + ``REDUCE``: ``os.system``, ``builtins.eval``), so moetrace never hands an
input to :func:`pickle.load`. :func:`load_plain` reads one in three guarded steps:

1. the file's size is bounded (limit ``max_pickle_bytes``) and it is read as bytes;
2. it is unpickled by :class:`PlainUnpickler`, whose ``find_class`` refuses every name and
   whose ``persistent_load`` refuses every id: the only ways a pickle reaches a callable
   or a class (``GLOBAL``, ``STACK_GLOBAL``, ``INST``, ``EXT1/2/4``, ``PERSID``), so
   ``REDUCE``, ``BUILD``, ``NEWOBJ`` and ``OBJ`` have nothing to call and nothing runs.
   When it refuses (or fails), the opcodes are listed with :func:`pickletools.genops`,
   which runs none, to name the first opcode outside :data:`PLAIN_OPCODES` and its byte
   offset (:func:`scan`);
3. the value is walked once to bound its depth (:data:`MAX_DEPTH`) and the number of
   objects reached through shared references (limit ``max_pickle_objects``: a memo-heavy
   file of a few hundred bytes can reach 2^40), the items of one dict or set (limit
   ``max_container_items``), and to refuse a structure containing itself, before anything
   else walks it.

Before step 2 the bytes are checked for hash flooding (:func:`check_hash_flooding`):
Python hashes an integer modulo 2^61-1, so keys k*(2^61-1) all collide and building a
dict of 150,000 of them takes minutes (quadratic). Integers that wide are rare in a real
dump (nanosecond timestamps stay below 2^61); more than :data:`MAX_WIDE_INTS` of them are
refused before anything is built. The same check runs on the pickle inside a ``.pt``
(``collect/_torchload.py``), whose ``weights_only`` loader builds dicts the same way.

Any failure is an :class:`~moetrace.errors.InputError` (one line, exit 2).
"""
from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
from itertools import chain
from pathlib import Path

from .errors import InputError
from .safety import check_regular_file, excerpt, limit, limit_error

#: opcodes that only push plain values, build plain containers, or manage the stack and
#: the memo. Everything else (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ,
#: NEWOBJ_EX, EXT1/2/4, PERSID, BINPERSID, NEXT_BUFFER, READONLY_BUFFER) is refused.
PLAIN_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT",
    "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
    "EMPTY_LIST", "APPEND", "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_SET", "ADDITEMS", "FROZENSET",
    "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
})

_WHAT = {
    "GLOBAL": "import a name", "STACK_GLOBAL": "import a name", "REDUCE": "call an object",
    "BUILD": "set an object's state", "INST": "create an instance of a class", "OBJ": "create an instance of a class",
    "NEWOBJ": "create an instance of a class", "NEWOBJ_EX": "create an instance of a class",
    "EXT1": "look up a registered class", "EXT2": "look up a registered class", "EXT4": "look up a registered class",
    "PERSID": "load a persistent object", "BINPERSID": "load a persistent object",
    "NEXT_BUFFER": "read an out-of-band buffer", "READONLY_BUFFER": "read an out-of-band buffer",
}

#: deepest nesting of containers accepted (a Flight Recorder dump nests 5 deep)
MAX_DEPTH = 64
#: integers of 2^61-1 or more in magnitude accepted in one pickle (their hashes can collide)
MAX_WIDE_INTS = 1000
_HASH_MOD = (1 << 61) - 1
#: where such an integer may be: LONG1 of 8 bytes whose top byte is 0x1f..0xdf, LONG1 of
#: more bytes, LONG4, or a text INT/LONG of 19+ digits (a match inside string data is
#: possible: the opcodes are then listed to count for sure)
_WIDE = re.compile(rb"\x8a\x08.{7}[\x1f-\xdf]|\x8a[\x09-\xff]|\x8b|[IL]-?\d{19,}", re.S)

_PLAIN_SET = frozenset({type(None), bool, int, float, str, bytes, bytearray})
_SEQ_SET = frozenset({list, tuple, set, frozenset})


class PlainUnpickler(pickle.Unpickler):
    """An unpickler that can build only what pickle builds without a name: every class or
    function lookup and every persistent id is refused."""

    def find_class(self, module, name):  # noqa: D102 - refuses everything
        raise pickle.UnpicklingError(f"refused to import {excerpt(module, 60)}.{excerpt(name, 60)}")

    def persistent_load(self, pid):  # noqa: D102
        raise pickle.UnpicklingError("refused a persistent id")


def is_pickle(head: bytes) -> bool:
    """True when ``head`` starts like a pickle of protocol 2 or later (``\\x80`` + version)."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def scan(data: bytes, path) -> int:
    """Refuse ``data`` unless every opcode is in :data:`PLAIN_OPCODES` (nothing is run;
    an error names the first other opcode and its byte); returns the number of opcodes."""
    cap = limit("max_pickle_objects")
    n = 0
    strings: list[str] = []   # the last strings pushed: what STACK_GLOBAL would import
    try:
        for op, arg, pos in pickletools.genops(io.BytesIO(data)):
            n += 1
            if n > cap:
                raise limit_error(path, "max_pickle_objects", f"a pickle of more than {cap} opcodes")
            name = op.name
            if name not in PLAIN_OPCODES:
                what = _WHAT.get(name, "do more than build plain values")
                shown = ""
                if name == "GLOBAL" and isinstance(arg, str):
                    shown = " " + excerpt(arg.replace(" ", "."), 80)
                elif name == "STACK_GLOBAL" and len(strings) >= 2:
                    shown = " " + excerpt(f"{strings[-2]}.{strings[-1]}", 80)
                raise InputError(path, f"refused: the pickle would {what} ({name}{shown}); moetrace builds only "
                                       "plain containers and scalars from a pickle and runs nothing",
                                 f"byte {pos}" if pos is not None else None)
            if isinstance(arg, str):
                strings = (strings + [arg])[-2:]
    except InputError:
        raise
    except (ValueError, EOFError, KeyError, IndexError, UnicodeDecodeError) as e:
        raise InputError(path, f"not a readable pickle (truncated or corrupt): {excerpt(str(e), 100)}") from None
    return n


def check_hash_flooding(data: bytes, path) -> None:
    """Refuse a pickle with more than :data:`MAX_WIDE_INTS` integers of magnitude 2^61-1 or
    more (module docstring), before it is unpickled. A byte search finds the candidates;
    only when it finds many are the opcodes listed (nothing run) to count them exactly."""
    if len(_WIDE.findall(data, 0)) <= MAX_WIDE_INTS:
        return
    n = 0
    try:
        for _op, arg, _pos in pickletools.genops(io.BytesIO(data)):
            if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) >= _HASH_MOD - 1:
                n += 1
                if n > MAX_WIDE_INTS:
                    raise InputError(path, f"refused: the pickle holds more than {MAX_WIDE_INTS} integers of 2^61 or "
                                           "more, whose hashes can be made to collide (a dict of them takes "
                                           "quadratic time to build); a real dump holds none")
    except InputError:
        raise
    except (ValueError, EOFError, KeyError, IndexError, UnicodeDecodeError) as e:
        raise InputError(path, f"not a readable pickle (truncated or corrupt): {excerpt(str(e), 100)}") from None


def _check_tree(obj, path, opaque: tuple = ()) -> None:
    """Bound the depth and the objects reached (shared references counted each time they
    are reached: what any later walk of the value costs), refuse a container holding
    itself and anything not plain."""
    cap = limit("max_pickle_objects")
    items = limit("max_container_items")
    seen = 0
    stack = [(iter((obj,)), None)]
    open_ids: set[int] = set()     # the containers on the current path
    while stack:
        it, cid = stack[-1]
        for o in it:
            seen += 1
            if seen > cap:
                raise limit_error(path, "max_pickle_objects", f"a pickle reaching more than {cap} objects")
            t = type(o)
            if t in _PLAIN_SET or opaque and isinstance(o, opaque):
                continue
            if t in (dict, set, frozenset) and len(o) > items:
                raise limit_error(path, "max_container_items", f"a {t.__name__} of {len(o)} items")
            if t is dict:
                children = chain.from_iterable(o.items())
            elif t in _SEQ_SET:
                children = iter(o)
            else:   # (cannot happen: nothing else can be built)
                raise InputError(path, f"refused: the pickle holds a {t.__name__}, not a plain value")
            i = id(o)
            if i in open_ids:
                raise InputError(path, "refused: the pickle holds a container that contains itself")
            if len(stack) > MAX_DEPTH:
                raise InputError(path, f"pickle nested more than {MAX_DEPTH} levels deep (a crafted or corrupt dump)")
            open_ids.add(i)
            stack.append((children, i))
            break
        else:
            stack.pop()
            if cid is not None:
                open_ids.discard(cid)


def load_plain(path: str | os.PathLike, data: bytes | None = None):
    """The plain value pickled in ``path`` (or ``data``), read as the module docstring says."""
    path = Path(path)
    cap = limit("max_pickle_bytes")
    if data is None:
        check_regular_file(path)
        try:
            size = os.stat(path).st_size
            if size > cap:
                raise limit_error(path, "max_pickle_bytes", f"a pickle of {size} bytes")
            data = path.read_bytes()
        except OSError as e:
            raise InputError(path, f"cannot read: {e.strerror}") from None
    if len(data) > cap:
        raise limit_error(path, "max_pickle_bytes", f"a pickle of {len(data)} bytes")
    if not data:
        raise InputError(path, "file is empty")
    check_hash_flooding(data, path)
    try:
        obj = PlainUnpickler(io.BytesIO(data)).load()
    except RecursionError:
        raise InputError(path, "pickle nested too deeply to read (a crafted or corrupt dump)") from None
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, KeyError, IndexError, AttributeError,
            UnicodeDecodeError, OverflowError, MemoryError) as e:
        scan(data, path)   # names the refused opcode and its byte, if that is what failed
        raise InputError(path, f"refused or unreadable pickle: {excerpt(str(e) or type(e).__name__, 100)}") from None
    _check_tree(obj, path)
    return obj


def check_reachable(obj, path, opaque: tuple = ()) -> None:
    """Bound a loaded value as step 3 says (depth, objects reached with shared references
    counted each time, dict/set items, no cycle); instances of ``opaque`` (tensors) count
    as one object and are not entered. For values another loader built (``.pt``)."""
    _check_tree(obj, path, opaque)
