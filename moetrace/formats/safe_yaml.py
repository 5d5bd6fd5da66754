"""YAML read safely: ``yaml.SafeLoader`` (no Python objects) with the document's size
counted *with every alias expanded* before anything is built from it.

A "billion laughs" file of a few hundred bytes nests anchors (``a: &a [x, x, ...]``,
``b: &b [*a, *a, ...]``, ...): PyYAML shares the anchored objects, so loading is cheap, but
anything that walks the result (a ``repr`` in an error message, ``np.asarray``, a
conversion) expands it to billions of values. :func:`load` composes the node graph (each
anchor once), counts the expanded nodes with a memo per node, and refuses a document over
the ``max_yaml_nodes`` limit (or one whose aliases form a cycle) with one line naming
the file, before a Python value is constructed.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..safety import how_to_raise, limit, limit_error


def _expanded_size(root, cap: int, path) -> int:
    import yaml

    memo: dict[int, int] = {}
    on_stack: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in on_stack:
            raise InputError(path, "YAML aliases refer to themselves (a recursive document)")
        on_stack.add(key)
        n = 1
        if isinstance(node, yaml.SequenceNode):
            for child in node.value:
                n += size(child)
                if n > cap:
                    break
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                n += size(k) + size(v)
                if n > cap:
                    break
        on_stack.discard(key)
        memo[key] = n
        return n

    return size(root)


def load(path: str | Path, text: str | None = None):
    """The YAML document in ``path`` (or ``text``), as ``yaml.safe_load`` gives it, after
    its expanded node count is checked against ``max_yaml_nodes``. Errors are InputError
    (invalid YAML with its line and column, not UTF-8, nested too deeply, too large)."""
    import yaml

    path = Path(path)
    try:
        if text is None:
            if path.stat().st_size > limit("max_yaml_bytes"):
                raise limit_error(path, "max_yaml_bytes", f"a YAML file of {path.stat().st_size} bytes")
            text = path.read_text(encoding="utf-8")
        elif len(text) > limit("max_yaml_bytes"):
            raise limit_error(path, "max_yaml_bytes", f"a YAML document of {len(text)} characters")
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            cap = limit("max_yaml_nodes")
            n = _expanded_size(node, cap, path)
            if n > cap:
                raise InputError(path, f"YAML document expands to more than {cap} nodes with its aliases expanded "
                                       f"(limit max_yaml_nodes={cap}); {how_to_raise('max_yaml_nodes')}")
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except UnicodeDecodeError:
        raise InputError(path, "not UTF-8 text") from None
    except OSError as e:
        raise InputError(path, f"cannot read: {e.strerror}") from None
    except RecursionError:
        raise InputError(path, "YAML nested too deeply to parse (more than the parser's recursion limit)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1} column {mark.column + 1}" if mark is not None else None
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InputError(path, f"invalid YAML: {problem}", where) from None
