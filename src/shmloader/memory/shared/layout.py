"""The flat layout of a shared structure: one buffer, read in place, never written again.

The buffer starts with a header (a magic number and the root's reference). Every value is
named by a *reference*, 16 bytes: a tag byte, seven bytes of padding, then 8 bytes of
payload. ``None``, ``bool``, an ``int`` that fits in 64 bits and a ``float`` live in the
reference itself. A ``str`` whose utf-8 is under 4 GiB is a *span*: its byte length (u32)
sits in the reference's bytes 4-7 and the payload is the offset of its bytes (anywhere,
unaligned, no header). Every other value is a *node* somewhere in the buffer, 8-byte
aligned, whose offset is the payload:

- ``str`` (4 GiB and over), ``bytes``, a larger ``int``: its length (u64), then its bytes
  (utf-8 with surrogates passed through; an ``int`` as signed little-endian bytes).
- a list or a tuple: a form byte and the count (u64), then by form: ``REFS``, one
  reference per item; ``STRS`` (every item a ``str``), count + 1 end offsets (u64) then
  the utf-8 bytes of all items; ``INTS`` / ``FLOATS`` (every item an ``int`` that fits /
  a ``float``), the int64 / float64 values.
- a dict: count and bucket count (u64 each), the 32-bit hash of every key (in insertion
  order, padded to 8 bytes), the keys' references, the values' references, then the
  buckets (u32: entry number + 1, 0 empty; linear probing). Small dicts have no buckets:
  their hashes are scanned. A key's hash is the CRC-32 of a canonical encoding
  (:func:`key_bytes`), the same in every process (``hash()`` of a ``str`` is not).
- a *record* (a dict whose keys are listed in a shared key table; the dicts of a dataset
  nearly always have the same keys, so each key tuple is stored once): the key table's
  offset and the count (u64 each), then the values' references. A key table: the count
  (u64), then the keys' references, in insertion order.
- a numpy array or scalar: ndim, the length of its dtype's description, the offset of
  its data (64-byte aligned), then the shape (u64 each) and the description (numpy's
  ``.npy`` header form: structured dtypes survive it).

Byte order is the machine's: the buffer never leaves it.
"""

from __future__ import annotations

import ast
import struct
import zlib
from typing import Any

import numpy as np

MAGIC = b"SHMOBJ01"
HEADER = struct.Struct("=8s")  # then the root's reference
ROOT = HEADER.size

REF = struct.Struct("=B7xQ")  # tag, node offset
REF_INT = struct.Struct("=B7xq")
REF_FLOAT = struct.Struct("=B7xd")
REF_SPAN = struct.Struct("=B3xIQ")  # tag, byte length, offset of the bytes
SPAN_MAX = 2**32  # a str of this many utf-8 bytes or more is a STR node
REF_SIZE = REF.size
# A reference as a numpy record (native byte order, as the structs'): columns of
# references are built as arrays of these.
REF_DTYPE = np.dtype(
    {"names": ["tag", "len", "payload"], "formats": ["u1", "u4", "u8"], "offsets": [0, 4, 8], "itemsize": 16}
)
U64 = struct.Struct("=Q")
I64 = struct.Struct("=q")
F64 = struct.Struct("=d")
U32 = struct.Struct("=I")
PAIR = struct.Struct("=QQ")
SEQ_HEAD = struct.Struct("=B7xQ")  # form, count
DICT_HEAD = struct.Struct("=QQ")  # count, buckets
RECORD_HEAD = struct.Struct("=QQ")  # key table's offset, count
ARRAY_HEAD = struct.Struct("=QQQQ")  # ndim, description length, data offset, data bytes

# Reference tags.
NONE, FALSE, TRUE, INT, FLOAT, STR, BYTES, BIGINT, LIST, TUPLE, DICT, ARRAY, SCALAR, SPAN, RECORD = range(15)
# Forms of a list's or tuple's node.
REFS, STRS, INTS, FLOATS = range(4)

SMALL_DICT = 8  # up to this many keys a lookup scans the hashes: no buckets to build or probe
# A dict of up to this many keys is a record while the buffer has fewer key tables than
# MAX_TABLES: each reading process keeps an index of every key table it reads, so both
# bound that memory; other dicts carry their own keys and buckets.
RECORD_KEYS = 256
MAX_TABLES = 1024
# Containers nest at most this deep (the root container is level 1): share() refuses a
# deeper structure, so a reader takes a deeper path through a segment for a corrupt one.
MAX_NESTING = 1000
KEY_DEPTH = 64  # tuples in a dict key nest at most this deep (the C reader's bound is 100)
ARRAY_ALIGN = 64  # numpy arrays' data start on a cache line, as numpy's own allocations do


def pad(n: int, to: int = 8) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def key_bytes(key: Any, depth: int = 0) -> bytes:
    """The canonical bytes of a dict key: equal keys (``1``, ``1.0``, ``True``;
    ``"a"`` and ``numpy.str_("a")``) give equal bytes, so their CRC-32 finds them in
    any process. A TypeError for a key of another type (it cannot be stored), or tuples
    nested more than :data:`KEY_DEPTH` deep (a reader builds a key whole, in one call)."""
    if isinstance(key, str):
        return b"s" + key.encode("utf-8", "surrogatepass")
    if isinstance(key, np.generic):
        return key_bytes(key.item())
    if isinstance(key, int):  # bool too: True == 1
        return _int_bytes(int(key))
    if isinstance(key, float):
        if key.is_integer():
            return _int_bytes(int(key))
        return b"f" + F64.pack(key)
    if isinstance(key, bytes):
        return b"b" + key
    if key is None:
        return b"n"
    if isinstance(key, tuple):
        if depth >= KEY_DEPTH:
            raise TypeError(f"a tuple nested more than {KEY_DEPTH} deep")
        parts = [key_bytes(k, depth + 1) for k in key]
        return b"t" + b"".join(U64.pack(len(p)) + p for p in parts)
    raise TypeError(type(key).__name__)


def _int_bytes(value: int) -> bytes:
    # Its bytes, not its decimal digits: str() of an int of over 4,300 digits raises.
    return b"i" + value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)


def key_hash(key: Any) -> int:
    """The stable 32-bit hash of a dict key (see :func:`key_bytes`)."""
    return zlib.crc32(key_bytes(key))


def dtype_description(dtype: np.dtype) -> bytes:
    """The dtype in numpy's ``.npy`` header form, which keeps structured dtypes' fields."""
    return repr(np.lib.format.dtype_to_descr(dtype)).encode()


def dtype_from_description(text: bytes) -> np.dtype:
    """The dtype :func:`dtype_description` wrote."""
    return np.lib.format.descr_to_dtype(ast.literal_eval(text.decode()))
