"""Reading YAML configs an operator can gate deployments on: one line for every way a file can be wrong.

``yaml.safe_load`` runs no code, but it still accepts documents that mean something other than what they
say or that cannot be processed: a key given twice (PyYAML keeps the last one silently, so a trailing
``defense: null`` disables the defense), aliases that expand exponentially (a "billion laughs" document is
a few hundred bytes, loads instantly as shared references and then exhausts memory in whatever walks it),
nesting deep enough to overflow the interpreter's stack, bytes that are not UTF-8, and an empty file (no
settings at all, which would otherwise read as "the defaults, no defense"). :func:`load_yaml` refuses each
with a :class:`~guardfl.errors.ConfigError` naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from guardfl.errors import ConfigError

#: largest config file read (bytes): configs are a few hundred bytes; data lives in data files
MAX_BYTES = 1_000_000
#: most nodes (scalars, list items, mapping entries) the document may expand to, aliases counted each time
MAX_NODES = 100_000
#: deepest nesting of mappings and lists
MAX_DEPTH = 40


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys in a mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' merges are not duplicates
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, f"unhashable key {key!r}", key_node.start_mark) from None
            if key in seen:
                line = key_node.start_mark.line + 1
                first = seen[key].start_mark.line + 1
                raise ConfigError(f"key {key!r} given twice (lines {first} and {line}); remove one")
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _check_shape(root: yaml.Node) -> None:
    """Bound the expanded size and the depth of the node graph before anything walks the loaded data.
    Counting runs over the composed node graph (aliases are the same node object), with each alias
    counted at every place it appears, and stops as soon as a bound is passed, so a billion-laughs
    document is refused after MAX_NODES steps."""
    count = 0
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise ConfigError(f"the document expands to more than {MAX_NODES:,} values (aliases counted where used); "
                              "a config is a few settings")
        if depth > MAX_DEPTH:
            raise ConfigError(f"the document nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack.append((k, depth + 1))
                stack.append((v, depth + 1))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, depth + 1) for v in node.value)


def parse_yaml(text: str, *, allow_empty: bool = False) -> Any:
    """Parse one YAML document under the bounds above (ConfigError without the file name)."""
    try:
        loader = _StrictLoader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                if allow_empty:
                    return None
                raise ConfigError("the file is empty (no settings); an empty config is not 'the defaults'")
            _check_shape(root)
            return loader.construct_document(root)
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        first = str(err).strip().splitlines()
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or (first[0] if first else "invalid")
        raise ConfigError(f"not valid YAML: {problem}{where}") from None
    except RecursionError:
        raise ConfigError(f"the document nests deeper than {MAX_DEPTH} levels") from None


def load_yaml(path: str | Path, *, allow_empty: bool = False) -> Any:
    """Read a YAML config file; every problem is one ConfigError line that starts with the file's name."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ConfigError(f"{path}: {size:,} bytes; a config file is at most {MAX_BYTES:,} bytes")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); save the config as UTF-8") from None
    try:
        return parse_yaml(text, allow_empty=allow_empty)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
