"""The one walker of batch trees: flatten, unflatten and map over typed nodes.

A batch (or a sample) is a tree whose inner nodes are mappings (``dict`` and its
subclasses, any ``collections.abc.Mapping``), lists, tuples and namedtuples, as in torch's
``default_collate``; everything else is a leaf. Every module that walks a batch
(collation, the write-into spec, the slot reader, torch output, pinning, the benchmarks)
goes through this one, so they agree on what a node is.

A *treedef* describes the nodes (nested tuples, hashable and picklable, so layouts can
key caches and cross processes)::

    LEAF                          a leaf
    ("d", cls, keys, children)    a mapping (cls: dict, a dict subclass, another Mapping,
                                  or (defaultdict class, factory): see mapping_type)
    ("l", children)               a list
    ("t", children)               a tuple
    ("n", cls, children)          a namedtuple
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

LEAF = None

DICT, LIST, TUPLE, NAMEDTUPLE = "d", "l", "t", "n"


def node_kind(x: Any) -> str | None:
    """The node tag of ``x`` (``"d"``, ``"l"``, ``"t"``, ``"n"``), or None for a leaf."""
    cls = type(x)
    if cls is dict:  # the common cases first: exact types need no ABC check
        return DICT
    if cls is list:
        return LIST
    if cls is tuple:
        return TUPLE
    if isinstance(x, tuple):
        return NAMEDTUPLE if hasattr(x, "_fields") else TUPLE
    if isinstance(x, list):
        return LIST
    if isinstance(x, Mapping):
        return DICT
    return None


def flatten(tree: Any, *, tuples_as_lists: bool = False) -> tuple[Any, list[Any]]:
    """``tree``'s treedef and its leaves, in order (depth first, mapping keys in their
    order). ``tuples_as_lists``: plain tuples become list nodes (torch's
    ``default_convert`` and ``default_collate`` turn tuples into lists)."""
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
        tag = LIST if tuples_as_lists else kind
        return (tag, tuple(walk(v) for v in node))

    treedef = walk(tree)
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
    _, cls, children = treedef  # namedtuple
    return cls(*(unflatten(c, leaves) for c in children))


def builder(treedef: Any) -> Callable[[list[Any]], Any]:
    """A function ``leaves -> tree`` equal to ``unflatten(treedef, iter(leaves))``, made
    once per layout: for a flat tree (every child a leaf, the common case) it is one call,
    without unflatten's walk. ``leaves`` must be a fresh list (a flat list tree is it)."""
    if treedef is LEAF:
        return lambda leaves: leaves[0]
    flat = all(child is LEAF for child in treedef[-1])
    if not flat:
        return lambda leaves: unflatten(treedef, iter(leaves))
    tag = treedef[0]
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


def tree_map(fn: Callable[[Any], Any], tree: Any, *, tuples_as_lists: bool = False) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)``, nodes rebuilt with their types."""
    if node_kind(tree) is None:
        return fn(tree)
    treedef, leaves = flatten(tree, tuples_as_lists=tuples_as_lists)
    return unflatten(treedef, map(fn, leaves))


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree``, in order."""
    return flatten(tree)[1]


def leaf_paths(tree: Any) -> list[tuple]:
    """The path (keys and positions from the root) of each leaf of ``tree``, in
    :func:`flatten`'s order: for error messages."""
    out: list[tuple] = []

    def walk(node: Any, path: tuple) -> None:
        kind = node_kind(node)
        if kind is None:
            out.append(path)
        elif kind == DICT:
            for k in node:
                walk(node[k], (*path, k))
        else:
            for i, v in enumerate(node):
                walk(v, (*path, i))

    walk(tree, ())
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
    """A mapping of type ``cls`` holding ``items`` (as torch's collate rebuilds one): the
    type's own constructor, else (a constructor with other arguments) an empty instance
    updated with the items, else a plain dict. ``cls`` may be :func:`mapping_type`'s
    (class, default_factory) pair."""
    if type(cls) is tuple:
        cls, factory = cls
        out = cls.__new__(cls)
        defaultdict.__init__(out, factory, items)
        return out
    try:
        return cls(items)
    except TypeError:
        pass
    if issubclass(cls, dict):
        try:
            out = cls.__new__(cls)
            dict.update(out, items)
            return out
        except TypeError:
            pass
    return items
