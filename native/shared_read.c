/* shmloader._shared_read: builds the plain Python value of one reference of a shared
 * structure (see src/shmloader/memory/shared/layout.py for the format), in one call.
 *
 * A forked worker reading a shared list of records through Python views pays a method
 * call and a view object per field; this builds a small container (a record, its lists,
 * its strings) as ordinary objects at once. Containers whose values, all the way down,
 * number more than the caller's budget are not built: the caller then makes a view.
 *
 * Only reads: the segment is mapped read-only, and every offset is checked against its
 * size before it is read. A corrupt segment gives shmloader.errors.CorruptDataError
 * (undecodable text and unhashable keys included), never a stray read; the work spent
 * on one call is bounded by the segment's size (key tables) or the caller's budget.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Reference tags and list forms: layout.py's numbering. */
enum {
    T_NONE, T_FALSE, T_TRUE, T_INT, T_FLOAT, T_STR, T_BYTES, T_BIGINT, T_LIST, T_TUPLE,
    T_DICT, T_ARRAY, T_SCALAR, T_SPAN, T_RECORD
};
enum { F_REFS, F_STRS, F_INTS, F_FLOATS };

#define REF_SIZE 16
#define SEQ_HEAD 16
#define DICT_HEAD 16
#define RECORD_HEAD 16

typedef struct {
    const unsigned char *base;
    uint64_t size;
    Py_ssize_t budget;   /* values left to build; below zero: too big, give up */
    PyObject *tables;    /* dict: key table offset -> tuple of its keys */
    PyObject *special;   /* callable(owner, pos): an array's, a numpy scalar's, a big int's value */
    PyObject *owner;
    int depth;           /* containers open: bounded, so a corrupt cycle cannot recurse on */
    int too_big;
} reader;

#define MAX_DEPTH 100

/* shmloader.errors.CorruptDataError, looked up when the module is loaded. */
static PyObject *CorruptError;

static int in_bounds(reader *r, uint64_t off, uint64_t len) {
    if (off > r->size || len > r->size - off) {
        PyErr_Format(CorruptError,
                     "a shared structure's segment is corrupt: %llu bytes at byte %llu lie "
                     "past its end (%llu bytes)",
                     (unsigned long long)len, (unsigned long long)off,
                     (unsigned long long)r->size);
        return 0;
    }
    return 1;
}

static PyObject *corrupt(const char *what) {
    PyErr_Format(CorruptError, "a shared structure's segment is corrupt: %s", what);
    return NULL;
}

/* The error set now (a UnicodeDecodeError, a TypeError) replaced by a CorruptDataError
 * saying what it was, chained to it. */
static PyObject *corrupt_from(const char *what) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    PyErr_Format(CorruptError, "a shared structure's segment is corrupt: %s (%S)", what,
                 value != NULL ? value : Py_None);
    if (value != NULL) {
        PyObject *t2, *v2, *tb2;
        PyErr_Fetch(&t2, &v2, &tb2);
        PyErr_NormalizeException(&t2, &v2, &tb2);
        PyException_SetCause(v2, value); /* steals value */
        Py_INCREF(value);
        PyException_SetContext(v2, value); /* steals value */
        PyErr_Restore(t2, v2, tb2);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return NULL;
}

static uint64_t u64_at(reader *r, uint64_t off) {
    uint64_t v;
    memcpy(&v, r->base + off, 8);
    return v;
}

/* Whether n more values fit the budget; where they do not, the budget is spent (-1)
 * and the value too big. */
static int affords(reader *r, uint64_t n) {
    if (r->budget < 0 || (uint64_t)r->budget < n) {
        r->budget = -1;
        r->too_big = 1;
        return 0;
    }
    return 1;
}

static int spend(reader *r, uint64_t n) {
    if (!affords(r, n)) return 0;
    r->budget -= (Py_ssize_t)n;
    return 1;
}

static PyObject *utf8(reader *r, uint64_t off, uint64_t n) {
    if (!in_bounds(r, off, n)) return NULL;
    PyObject *out = PyUnicode_DecodeUTF8((const char *)r->base + off, (Py_ssize_t)n, "surrogatepass");
    if (out == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
        return corrupt_from("a string's bytes are not utf-8");
    return out;
}

/* Every value's reference below: ``limit`` is the offset of the node that holds it (the
 * segment's size for the root). An encoder writes a container's children before it, so
 * a container's node lies before the node that refers to it: one at or past it is
 * corrupt, and no path through a segment can loop. */
static PyObject *value(reader *r, uint64_t pos, uint64_t limit);

/* The items of a list's or tuple's node at off, into a new list (tuple: converted). */
static PyObject *sequence(reader *r, uint64_t off, int as_tuple) {
    if (!in_bounds(r, off, SEQ_HEAD)) return NULL;
    int form = r->base[off];
    uint64_t n = u64_at(r, off + 8);
    uint64_t data = off + SEQ_HEAD;
    if (n > r->size) return corrupt("a list's count exceeds the segment");
    if (form > F_FLOATS) return corrupt("a list has an unknown form");
    /* Its items checked to lie in the segment before its list is made. */
    uint64_t width = form == F_REFS ? REF_SIZE : 8;
    if (!in_bounds(r, data, width * n + (form == F_STRS ? 8 : 0))) return NULL;
    /* A packed item is spent here; a reference spends its own budget, but more of them
     * than the budget is too big before any is built. */
    if (form != F_REFS && !spend(r, n)) return NULL;
    if (form == F_REFS && !affords(r, n)) return NULL;
    PyObject *out = as_tuple ? PyTuple_New((Py_ssize_t)n) : PyList_New((Py_ssize_t)n);
    if (out == NULL) return NULL;
    for (uint64_t i = 0; i < n; i++) {
        PyObject *item;
        if (form == F_REFS) {
            item = value(r, data + REF_SIZE * i, off);
        } else if (form == F_INTS) {
            int64_t v;
            memcpy(&v, r->base + data + 8 * i, 8);
            item = PyLong_FromLongLong(v);
        } else if (form == F_FLOATS) {
            double v;
            memcpy(&v, r->base + data + 8 * i, 8);
            item = PyFloat_FromDouble(v);
        } else if (form == F_STRS) {
            uint64_t a = u64_at(r, data + 8 * i), b = u64_at(r, data + 8 * (i + 1));
            uint64_t blob = data + 8 * (n + 1);
            item = b < a ? corrupt("a string ends before it starts") : utf8(r, blob + a, b - a);
        } else {
            item = corrupt("a list has an unknown form");
        }
        if (item == NULL) goto fail;
        if (as_tuple)
            PyTuple_SET_ITEM(out, (Py_ssize_t)i, item);
        else
            PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* The keys of the key table at off, as a tuple, decoded once per reader's cache. */
static PyObject *table_keys(reader *r, uint64_t off) {
    PyObject *key = PyLong_FromUnsignedLongLong(off);
    if (key == NULL) return NULL;
    PyObject *found = PyDict_GetItemWithError(r->tables, key);
    if (found != NULL) {
        Py_DECREF(key);
        Py_INCREF(found);
        return found;
    }
    if (PyErr_Occurred() || !in_bounds(r, off, 8)) goto fail;
    uint64_t n = u64_at(r, off);
    if (n > r->size) {
        corrupt("a key table's count exceeds the segment");
        goto fail;
    }
    if (!in_bounds(r, off + 8, REF_SIZE * n)) goto fail;
    /* Keys are built whatever the caller's budget (they are few, and cached), but within
     * the segment's: each value an encoder writes takes 8 bytes or more of it, so keys
     * that build more values than size / 8 were not written by one (a node referenced
     * twice per level would build 2**depth). */
    Py_ssize_t saved = r->budget;
    r->budget = (Py_ssize_t)(r->size / 8 + 1);
    PyObject *keys = PyTuple_New((Py_ssize_t)n);
    for (uint64_t i = 0; keys != NULL && i < n; i++) {
        PyObject *k = value(r, off + 8 + REF_SIZE * i, off);
        if (k == NULL) {
            Py_CLEAR(keys);
            break;
        }
        PyTuple_SET_ITEM(keys, (Py_ssize_t)i, k);
    }
    int exhausted = keys == NULL && r->budget < 0 && !PyErr_Occurred();
    r->budget = saved;
    if (exhausted) {
        r->too_big = 0;
        corrupt("a key table's keys hold more values than the segment has room for");
    }
    if (keys == NULL || PyDict_SetItem(r->tables, key, keys) < 0) {
        Py_XDECREF(keys);
        goto fail;
    }
    Py_DECREF(key);
    return keys;
fail:
    Py_DECREF(key);
    return NULL;
}

/* A dict from n keys (a tuple, or n key references at keys_at) and n value references. */
static PyObject *mapping(reader *r, PyObject *keys, uint64_t keys_at, uint64_t values_at, uint64_t n,
                         uint64_t node) {
    if (!in_bounds(r, values_at, REF_SIZE * n)) return NULL;
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    for (uint64_t i = 0; i < n; i++) {
        PyObject *k;
        if (keys != NULL) {
            k = PyTuple_GET_ITEM(keys, (Py_ssize_t)i);
            Py_INCREF(k);
        } else {
            k = value(r, keys_at + REF_SIZE * i, node);
        }
        if (k == NULL) goto fail;
        PyObject *v = value(r, values_at + REF_SIZE * i, node);
        if (v == NULL) {
            Py_DECREF(k);
            goto fail;
        }
        int err = PyDict_SetItem(out, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
        if (err < 0) {
            if (PyErr_ExceptionMatches(PyExc_TypeError)) corrupt_from("a dict's key is unhashable");
            goto fail;
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *value_here(reader *r, uint64_t pos, uint64_t limit);

static PyObject *value(reader *r, uint64_t pos, uint64_t limit) {
    if (r->depth >= MAX_DEPTH) { /* deeper than this: the caller's views read it lazily */
        r->too_big = 1;
        return NULL;
    }
    r->depth++;
    PyObject *out = value_here(r, pos, limit);
    r->depth--;
    return out;
}

static PyObject *value_here(reader *r, uint64_t pos, uint64_t limit) {
    if (!in_bounds(r, pos, REF_SIZE) || !spend(r, 1)) return NULL;
    const unsigned char *ref = r->base + pos;
    int tag = ref[0];
    uint64_t payload = u64_at(r, pos + 8);
    if ((tag == T_LIST || tag == T_TUPLE || tag == T_DICT || tag == T_RECORD) && payload >= limit)
        return corrupt("a container refers to one at or after itself");
    switch (tag) {
    case T_NONE:
        Py_RETURN_NONE;
    case T_FALSE:
        Py_RETURN_FALSE;
    case T_TRUE:
        Py_RETURN_TRUE;
    case T_INT: {
        int64_t v;
        memcpy(&v, ref + 8, 8);
        return PyLong_FromLongLong(v);
    }
    case T_FLOAT: {
        double v;
        memcpy(&v, ref + 8, 8);
        return PyFloat_FromDouble(v);
    }
    case T_SPAN: {
        uint32_t n;
        memcpy(&n, ref + 4, 4);
        return utf8(r, payload, n);
    }
    case T_STR:
    case T_BYTES: {
        if (!in_bounds(r, payload, 8)) return NULL;
        uint64_t n = u64_at(r, payload);
        if (tag == T_STR) return utf8(r, payload + 8, n);
        if (!in_bounds(r, payload + 8, n)) return NULL;
        return PyBytes_FromStringAndSize((const char *)r->base + payload + 8, (Py_ssize_t)n);
    }
    case T_LIST:
    case T_TUPLE:
        return sequence(r, payload, tag == T_TUPLE);
    case T_RECORD: {
        if (!in_bounds(r, payload, RECORD_HEAD)) return NULL;
        uint64_t n = u64_at(r, payload + 8);
        if (n > r->size) return corrupt("a record's count exceeds the segment");
        if (!affords(r, n)) return NULL; /* too big: spare decoding its keys */
        if (u64_at(r, payload) >= payload) return corrupt("a record's key table lies at or after it");
        PyObject *keys = table_keys(r, u64_at(r, payload));
        if (keys == NULL) return NULL;
        if ((uint64_t)PyTuple_GET_SIZE(keys) != n) {
            Py_DECREF(keys);
            return corrupt("a record's count is not its key table's");
        }
        PyObject *out = mapping(r, keys, 0, payload + RECORD_HEAD, n, payload);
        Py_DECREF(keys);
        return out;
    }
    case T_DICT: {
        if (!in_bounds(r, payload, DICT_HEAD)) return NULL;
        uint64_t n = u64_at(r, payload);
        if (n > r->size) return corrupt("a dict's count exceeds the segment");
        if (!affords(r, n)) return NULL;
        uint64_t keys_at = payload + DICT_HEAD + ((4 * n + 7) / 8) * 8;
        if (!in_bounds(r, keys_at, REF_SIZE * n)) return NULL;
        return mapping(r, NULL, keys_at, keys_at + REF_SIZE * n, n, payload);
    }
    case T_ARRAY:
    case T_SCALAR:
    case T_BIGINT:
        return PyObject_CallFunction(r->special, "OK", r->owner, (unsigned long long)pos);
    default:
        PyErr_Format(CorruptError,
                     "a shared structure holds an unknown tag %d at byte %llu: its segment is "
                     "corrupt.",
                     tag, (unsigned long long)pos);
        return NULL;
    }
}

PyDoc_STRVAR(build_doc,
             "build(segment, pos, budget, tables, special, owner, too_big, limit)\n\n"
             "The plain value of the reference at byte pos of segment (a buffer): containers\n"
             "as lists, tuples and dicts. too_big where it holds more than budget values in\n"
             "all. tables caches key tables (offset -> tuple of keys); special(owner, pos)\n"
             "gives the value of an array, a numpy scalar or a big int. limit: the offset of\n"
             "the node holding the reference (a container there or past it is corrupt).");

static PyObject *build(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "build() takes 8 arguments");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    unsigned long long pos = PyLong_AsUnsignedLongLong(args[1]);
    Py_ssize_t budget = PyLong_AsSsize_t(args[2]);
    unsigned long long limit = PyLong_AsUnsignedLongLong(args[7]);
    PyObject *out = NULL;
    if (!PyErr_Occurred()) {
        if (!PyDict_Check(args[3])) {
            PyErr_SetString(PyExc_TypeError, "build(): tables must be a dict");
        } else {
            reader r = {view.buf, (uint64_t)view.len, budget, args[3], args[4], args[5], 0, 0};
            out = value(&r, pos, limit);
            if (out == NULL && r.too_big && !PyErr_Occurred()) {
                out = args[6];
                Py_INCREF(out);
            }
        }
    }
    PyBuffer_Release(&view);
    return out;
}

PyDoc_STRVAR(item_doc,
             "item(segment, pos, index, is_tuple, budget, tables, special, owner, too_big)\n\n"
             "Item index (an int, negative from the end) of the list or tuple whose node is at\n"
             "byte pos of segment, as build() gives it: one call for a str, int or float of a\n"
             "packed list. IndexError where it is out of range.");

/* One item of the sequence node at pos: its bounds checked, a packed item decoded here,
 * a reference's value built as build() builds it. */
static PyObject *item_of(reader *r, uint64_t pos, PyObject *index, int is_tuple) {
    const char *kind = is_tuple ? "tuple" : "list";
    if (!PyIndex_Check(index))
        return PyErr_Format(PyExc_TypeError, "%s indices must be integers or slices, not %.200s", kind,
                            Py_TYPE(index)->tp_name);
    Py_ssize_t i = PyNumber_AsSsize_t(index, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (!in_bounds(r, pos, SEQ_HEAD)) return NULL;
    int form = r->base[pos];
    uint64_t n = u64_at(r, pos + 8), data = pos + SEQ_HEAD;
    if (n > r->size) return corrupt("a list's count exceeds the segment");
    if (i < 0) i += (Py_ssize_t)n;
    if (i < 0 || (uint64_t)i >= n) return PyErr_Format(PyExc_IndexError, "%s index out of range", kind);
    uint64_t k = (uint64_t)i;
    switch (form) {
    case F_REFS:
        if (!in_bounds(r, data + REF_SIZE * k, REF_SIZE)) return NULL;
        return value(r, data + REF_SIZE * k, pos);
    case F_INTS: {
        int64_t v;
        if (!in_bounds(r, data + 8 * k, 8)) return NULL;
        memcpy(&v, r->base + data + 8 * k, 8);
        return PyLong_FromLongLong(v);
    }
    case F_FLOATS: {
        double v;
        if (!in_bounds(r, data + 8 * k, 8)) return NULL;
        memcpy(&v, r->base + data + 8 * k, 8);
        return PyFloat_FromDouble(v);
    }
    case F_STRS: {
        if (!in_bounds(r, data, 8 * (n + 1))) return NULL;
        uint64_t a = u64_at(r, data + 8 * k), b = u64_at(r, data + 8 * (k + 1));
        if (b < a) return corrupt("a string ends before it starts");
        return utf8(r, data + 8 * (n + 1) + a, b - a);
    }
    default:
        return corrupt("a list has an unknown form");
    }
}

static PyObject *item(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "item() takes 9 arguments");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    unsigned long long pos = PyLong_AsUnsignedLongLong(args[1]);
    Py_ssize_t budget = PyLong_AsSsize_t(args[4]);
    PyObject *out = NULL;
    if (!PyErr_Occurred()) {
        if (!PyDict_Check(args[5])) {
            PyErr_SetString(PyExc_TypeError, "item(): tables must be a dict");
        } else {
            reader r = {view.buf, (uint64_t)view.len, budget, args[5], args[6], args[7], 0, 0};
            out = item_of(&r, pos, args[2], PyObject_IsTrue(args[3]));
            if (out == NULL && r.too_big && !PyErr_Occurred()) {
                out = args[8];
                Py_INCREF(out);
            }
        }
    }
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"build", (PyCFunction)(void (*)(void))build, METH_FASTCALL, build_doc},
    {"item", (PyCFunction)(void (*)(void))item, METH_FASTCALL, item_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmloader._shared_read",
    "Builds plain values of shared structures (see shmloader.memory.shared.views).", -1, methods,
};

PyMODINIT_FUNC PyInit__shared_read(void) {
    if (CorruptError == NULL) {
        PyObject *errors = PyImport_ImportModule("shmloader.errors");
        if (errors == NULL) return NULL;
        CorruptError = PyObject_GetAttrString(errors, "CorruptDataError");
        Py_DECREF(errors);
        if (CorruptError == NULL) return NULL;
    }
    return PyModule_Create(&module);
}
