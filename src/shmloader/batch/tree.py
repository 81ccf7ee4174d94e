"""The one walker of batch trees: flatten, unflatten and map over typed nodes.

A batch (or a sample) is a tree whose inner nodes are mappings (any
``collections.abc.Mapping``), sequences (lists, tuples, namedtuples, a ``deque``, a
``UserList``, any ``collections.abc.Sequence`` but str and bytes), as in torch's
``default_collate``; everything else is a leaf. Every module that walks a batch
(collation, the write-into spec, the slot reader, torch output, pinning, the benchmarks)
goes through this one, so they agree on what a node is.

A *treedef* describes the nodes (nested tuples, hashable and picklable, so layouts can
key caches and cross processes)::

    LEAF                          a leaf
    ("d", cls, keys, children)    a mapping (cls: dict, OrderedDict, a dict subclass
                                  whose instance has no attributes, another immutable
                                  Mapping, or (defaultdict, factory): see mapping_type)
    ("l", children)               a list
    ("t", children)               a tuple
    ("n", cls, children)          a namedtuple
    ("c", keys, children)         a node rebuilt as torch rebuilds a mutable mapping or
                                  sequence that is not one of the above (a deque, a
                                  UserList, a list subclass, a dict subclass with
                                  attributes): a shallow copy of it (a :class:`Shell`, its
                                  first leaf) with its items replaced; keys: the mapping's
                                  keys, or None for a sequence (items by position)
    ("s", cls, children)          another sequence (a range...): ``cls(items)``, or the
                                  list of items where cls refuses one (torch's rule)
"""

from __future__ import annotations

import copy
import io
import pickle
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

LEAF = None

DICT, LIST, TUPLE, NAMEDTUPLE, CLONE, SEQUENCE = "d", "l", "t", "n", "c", "s"


def node_kind(x: Any) -> str | None:
    """The node tag of ``x`` (``"d"``, ``"l"``, ``"t"``, ``"n"``, ``"c"``, ``"s"``), or
    None for a leaf. Its class decides (once per class), and for a dict subclass whether
    the instance has attributes: torch's collate copies them (``copy.copy``), a "c" node."""
    cls = type(x)
    if cls is dict:  # the common cases first: exact types need no lookup
        return DICT
    if cls is list:
        return LIST
    if cls is tuple:
        return TUPLE
    kind = _CLASS_KINDS.get(cls, _UNKNOWN)
    if kind is _UNKNOWN:
        kind = _class_kind(cls)
    if kind is _DICT_UNLESS_ATTRIBUTES:
        return CLONE if getattr(x, "__dict__", None) else DICT
    return kind


_UNKNOWN = object()
_DICT_UNLESS_ATTRIBUTES = "d?"
_CLASS_KINDS: dict[type, Any] = {}  # class -> its node kind (None: a leaf)
# Where a dict subclass (or a class between it and dict) defines one of these, copy.copy
# of it may be more than a new instance holding the same items: a "c" node.
_COPY_HOOKS = ("__copy__", "__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__slots__")


def _class_kind(cls: type) -> Any:
    """The node kind of instances of ``cls`` (see :func:`node_kind`), as torch's collate
    tells them apart: str and bytes are leaves; then mappings, namedtuples, sequences."""
    if issubclass(cls, (str, bytes)):
        kind = None
    elif issubclass(cls, tuple):
        kind = NAMEDTUPLE if hasattr(cls, "_fields") else TUPLE
    elif issubclass(cls, Mapping):
        if cls is OrderedDict or cls is defaultdict:
            kind = DICT
        elif issubclass(cls, dict) and not any(
            hook in vars(base) for base in cls.__mro__[: cls.__mro__.index(dict)] for hook in _COPY_HOOKS
        ):
            kind = _DICT_UNLESS_ATTRIBUTES
        elif issubclass(cls, MutableMapping):
            kind = CLONE
        else:
            kind = DICT  # immutable: torch makes ``cls(items)``
    elif issubclass(cls, MutableSequence):
        kind = CLONE
    elif issubclass(cls, Sequence):
        kind = SEQUENCE
    else:
        kind = None
    if len(_CLASS_KINDS) >= 4096:
        _CLASS_KINDS.clear()  # stay bounded (classes made in a loop)
    _CLASS_KINDS[cls] = kind
    return kind


class Shell:
    """The container of a "c" node: a shallow copy (``copy.copy``) of a mapping or
    mutable sequence, so of its type and attributes (a deque's ``maxlen``, a UserList
    subclass's fields), into which :meth:`filled` puts the node's new items, as torch's
    collate and convert rebuild such a node (``clone = copy.copy(elem)``, then
    ``clone.update(...)`` or ``clone[i] = ...``). ``items``: the node's items the copy
    still holds: pickled, the copy leaves them out (they are replaced, and may be large
    arrays), so an attribute that is one of them comes back None until replaced."""

    __slots__ = ("items", "node")

    def __init__(self, node: Any, items: Any = ()) -> None:
        self.node = node
        self.items = items

    @classmethod
    def of(cls, node: Any) -> Shell | None:
        """The shell of ``node`` (a mapping or a mutable sequence); None where it cannot
        be copied (torch's collate then makes a plain dict or list)."""
        try:
            return cls(copy.copy(node), list(node.values() if isinstance(node, Mapping) else node))
        except TypeError:
            return None

    def filled(self, keys: tuple | None, values: list) -> Any:
        """The copy holding ``values``: under ``keys`` (a mapping) or by position; the
        plain dict or list torch falls back to where the copy refuses them (TypeError).
        A mapping's values go in by its ``update``, as torch's collate puts them (a
        ``Counter``'s update adds them to the copied counts, there as here)."""
        node = self.node
        try:
            if keys is not None:
                self.put(node, dict(zip(keys, values)))
            else:
                for i, value in enumerate(values):
                    node[i] = value
            return node
        except TypeError:
            return dict(zip(keys, values)) if keys is not None else list(values)

    @staticmethod
    def put(node: Any, items: dict) -> None:
        """Put a mapping node's new ``items`` into its copy (torch's collate: ``update``)."""
        node.update(items)

    def __reduce__(self) -> tuple:
        hidden = {id(v) for v in self.items if type(v) not in _ATOMIC}
        out = io.BytesIO()
        _Hiding(out, hidden).dump(self.node)
        return (_unpickled_shell, (out.getvalue(),))


_ATOMIC = frozenset({int, float, bool, complex, str, bytes, type(None)})  # ids may be shared: kept


class _ReplacingShell(Shell):
    """The shell of a node that :func:`tree_map` rebuilds: its copy already holds the
    node's items, so each is replaced by its mapped value (``node[key] = value``), never
    combined with it (a ``Counter``'s ``update`` would add the counts again)."""

    __slots__ = ()

    @staticmethod
    def put(node: Any, items: dict) -> None:
        for key, value in items.items():
            node[key] = value


class _Hiding(pickle.Pickler):
    """Pickles an object with the objects of ids ``hidden`` left out (read back as None)."""

    def __init__(self, file: Any, hidden: set[int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.hidden = hidden

    def persistent_id(self, obj: Any) -> Any:
        return 0 if id(obj) in self.hidden else None


class _Unhiding(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> None:
        return None


def _unpickled_shell(data: bytes) -> Shell:
    return Shell(_Unhiding(io.BytesIO(data)).load())


def sequence_of(cls: type, items: list) -> Any:
    """A "s" node: ``cls(items)``, or ``items`` where cls refuses a list (torch's rule)."""
    try:
        return cls(items)
    except TypeError:
        return items


def flatten(tree: Any, *, tuples_as_lists: bool = False) -> tuple[Any, list[Any]]:
    """``tree``'s treedef and its leaves, in order (depth first, mapping keys in their
    order; a "c" node's :class:`Shell` before its items). ``tuples_as_lists``: torch's
    ``default_convert`` rules, which turn tuples into lists and other immutable sequences
    into "s" nodes; without it those are kept as they are (a tuple node; a leaf)."""
    leaves: list[Any] = []

    def walk(node: Any) -> Any:
        kind = node_kind(node)
        if kind is None:
            leaves.append(node)
            return LEAF
        if kind == DICT:
            keys = tuple(node.keys())
            return (DICT, mapping_type(node), keys, tuple(walk(node[k]) for k in keys))
        if kind == NAMEDTUPLE:
            return (NAMEDTUPLE, type(node), tuple(walk(v) for v in node))
        if kind == CLONE:
            shell = Shell.of(node)
            if shell is None:  # cannot be copied: kept whole
                leaves.append(node)
                return LEAF
            leaves.append(shell)
            if isinstance(node, Mapping):
                keys = tuple(node.keys())
                return (CLONE, keys, tuple(walk(node[k]) for k in keys))
            return (CLONE, None, tuple(walk(v) for v in node))
        if kind == SEQUENCE:
            if not tuples_as_lists:
                leaves.append(node)
                return LEAF
            return (SEQUENCE, type(node), tuple(walk(v) for v in node))
        tag = LIST if tuples_as_lists else kind
        return (tag, tuple(walk(v) for v in node))

    try:
        treedef = walk(tree)
    finally:
        walk = None  # type: ignore[assignment]  # else the recursive closure is a cycle holding the leaves
    return treedef, leaves


def unflatten(treedef: Any, leaves: Iterator[Any]) -> Any:
    """Rebuild the tree described by ``treedef``, taking leaves in order from ``leaves``."""
    if treedef is LEAF:
        return next(leaves)
    tag = treedef[0]
    if tag == LIST:
        return [unflatten(c, leaves) for c in treedef[1]]
    if tag == TUPLE:
        return tuple(unflatten(c, leaves) for c in treedef[1])
    if tag == DICT:
        _, cls, keys, children = treedef
        items = {k: unflatten(c, leaves) for k, c in zip(keys, children)}
        return items if cls is dict else make_mapping(cls, items)
    if tag == CLONE:
        _, keys, children = treedef
        shell = next(leaves)
        return shell.filled(keys, [unflatten(c, leaves) for c in children])
    _, cls, children = treedef  # namedtuple, or another sequence
    if tag == SEQUENCE:
        return sequence_of(cls, [unflatten(c, leaves) for c in children])
    return cls(*(unflatten(c, leaves) for c in children))


def builder(treedef: Any) -> Callable[[list[Any]], Any]:
    """A function ``leaves -> tree`` equal to ``unflatten(treedef, iter(leaves))``, made
    once per layout: for a flat tree (every child a leaf, the common case) it is one call,
    without unflatten's walk. ``leaves`` must be a fresh list (a flat list tree is it)."""
    if treedef is LEAF:
        return lambda leaves: leaves[0]
    tag = treedef[0]
    flat = tag != CLONE and tag != SEQUENCE and all(child is LEAF for child in treedef[-1])
    if not flat:
        return lambda leaves: unflatten(treedef, iter(leaves))
    if tag == LIST:
        return lambda leaves: leaves
    if tag == TUPLE:
        return tuple
    if tag == NAMEDTUPLE:
        cls = treedef[1]
        return lambda leaves: cls(*leaves)
    _, cls, keys, _ = treedef
    if cls is dict:
        return lambda leaves: dict(zip(keys, leaves))
    return lambda leaves: make_mapping(cls, dict(zip(keys, leaves)))


def tree_map(
    fn: Callable[[Any], Any], tree: Any, *, tuples_as_lists: bool = False, as_torch_copies: bool = False
) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)``, nodes rebuilt with their types: a
    "c" node's copy gets each item replaced, or with ``as_torch_copies`` its mapping's items
    put in by ``update``, as torch's ``default_convert`` rebuilds it (so a ``Counter``'s
    counts are added to the copied ones, as there)."""
    if node_kind(tree) is None:
        return fn(tree)
    treedef, leaves = flatten(tree, tuples_as_lists=tuples_as_lists)
    if as_torch_copies:
        return unflatten(treedef, (v if type(v) is Shell else fn(v) for v in leaves))
    return unflatten(treedef, (_ReplacingShell(v.node) if type(v) is Shell else fn(v) for v in leaves))


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree``, in order (without the shells of "c" nodes)."""
    return [v for v in flatten(tree)[1] if type(v) is not Shell]


def leaf_paths(tree: Any) -> list[tuple]:
    """The path (keys and positions from the root) of each leaf of ``tree``, in
    :func:`flatten`'s order: for error messages."""
    out: list[tuple] = []

    def walk(node: Any, path: tuple) -> None:
        kind = node_kind(node)
        if kind is None or kind == SEQUENCE:
            out.append(path)
            return
        if kind == CLONE:
            out.append(path)  # its shell (or the node itself, where it cannot be copied)
            if Shell.of(node) is None:
                return
        if isinstance(node, Mapping):
            for k in node:
                walk(node[k], (*path, k))
        else:
            for i, v in enumerate(node):
                walk(v, (*path, i))

    try:
        walk(tree, ())
    finally:
        walk = None  # type: ignore[assignment]  # else the recursive closure is a reference cycle
    return out


def path_text(path: tuple) -> str:
    """``path`` as indexing text, e.g. ``['image'][0]``; ``<sample>`` for the root."""
    return "".join(f"[{p!r}]" for p in path) or "<sample>"


def mapping_type(node: Any) -> Any:
    """What a treedef records of a mapping's type: the class, or for a defaultdict the
    pair (class, default_factory), so it comes back with its factory as torch keeps it."""
    cls = type(node)
    if cls is dict:
        return dict
    if isinstance(node, defaultdict):
        factory = node.default_factory
        # A class (list, int...) crosses processes in a layout; a lambda would not pickle.
        return (cls, factory if isinstance(factory, type) else None)
    return cls


def make_mapping(cls: Any, items: dict) -> Any:
    """A mapping of type ``cls`` holding ``items``, as torch's collate rebuilds one: a dict
    subclass (an instance without attributes: see :func:`node_kind`) as its copy would be,
    a new instance (``__init__`` is not called) updated with the items; an immutable
    Mapping by its constructor; a plain dict where either refuses (TypeError). ``cls``
    may be :func:`mapping_type`'s (class, default_factory) pair."""
    if type(cls) is tuple:
        cls, factory = cls
        out = cls.__new__(cls)
        defaultdict.__init__(out, factory, items)
        return out
    if cls is OrderedDict:
        return OrderedDict(items)
    try:
        if issubclass(cls, dict):
            out = cls.__new__(cls)
            out.update(items)
            return out
        return cls(items)
    except TypeError:
        return items
