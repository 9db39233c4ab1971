/* The codecs' inner loops in C: byte planes split and joined, sub-delta lanes.
 *
 * The optional native half of chunkstore.codecs.planes and
 * chunkstore.codecs.subdelta, which hold the contracts and numpy fallbacks
 * that give the same bytes (tests/test_native.py compares them).
 *
 * - numpy does a byte-plane split or join as a strided copy per plane, about
 *   2.4 GB/s here; the loops below write whole elements and run at 7-9 GB/s,
 *   so the shuffle a float chunk passes through on every save and restore
 *   stops costing more than its zstd.
 * - A sub-delta image (zigzag of chunk - base, lane by lane) and its inverse
 *   take numpy four or five passes over the chunk (1.3-1.5 GB/s); here, one.
 *
 * Every function checks every length before touching memory and releases the
 * GIL while it works, so the store's worker threads run on every core.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Most planes a split or join takes: the element sizes of the dtypes chunkstore
 * stores are 1 to 16 bytes; the Python side never passes more. */
#define MAX_PLANES 64

static void split_elements(const uint8_t *restrict src, uint8_t *restrict dst,
                           Py_ssize_t count, Py_ssize_t size)
{
    if (size == 2) {
        uint8_t *p0 = dst, *p1 = dst + count;
        for (Py_ssize_t i = 0; i < count; i++) {
            uint16_t x;
            memcpy(&x, src + 2 * i, 2);
            p0[i] = (uint8_t)x;
            p1[i] = (uint8_t)(x >> 8);
        }
    } else if (size == 4) {
        uint8_t *p0 = dst, *p1 = dst + count, *p2 = dst + 2 * count, *p3 = dst + 3 * count;
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t x;
            memcpy(&x, src + 4 * i, 4);
            p0[i] = (uint8_t)x;
            p1[i] = (uint8_t)(x >> 8);
            p2[i] = (uint8_t)(x >> 16);
            p3[i] = (uint8_t)(x >> 24);
        }
    } else {
        for (Py_ssize_t j = 0; j < size; j++) {
            uint8_t *p = dst + j * count;
            for (Py_ssize_t i = 0; i < count; i++)
                p[i] = src[i * size + j];
        }
    }
}

static void join_elements(const uint8_t *const *planes, uint8_t *restrict dst,
                          Py_ssize_t count, Py_ssize_t size)
{
    if (size == 2) {
        const uint8_t *p0 = planes[0], *p1 = planes[1];
        for (Py_ssize_t i = 0; i < count; i++) {
            uint16_t x = (uint16_t)(p0[i] | (p1[i] << 8));
            memcpy(dst + 2 * i, &x, 2);
        }
    } else if (size == 4) {
        const uint8_t *p0 = planes[0], *p1 = planes[1], *p2 = planes[2], *p3 = planes[3];
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t x = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8)
                         | ((uint32_t)p2[i] << 16) | ((uint32_t)p3[i] << 24);
            memcpy(dst + 4 * i, &x, 4);
        }
    } else {
        for (Py_ssize_t j = 0; j < size; j++) {
            const uint8_t *p = planes[j];
            for (Py_ssize_t i = 0; i < count; i++)
                dst[i * size + j] = p[i];
        }
    }
}

/* The host is little-endian (checked at import): the 2- and 4-byte loops read
 * an element as an integer whose low byte is its first byte. */
static int little_endian(void)
{
    const uint16_t one = 1;
    uint8_t first;
    memcpy(&first, &one, 1);
    return first == 1;
}

PyDoc_STRVAR(split_doc,
"split(src, dst, element_size)\n\n"
"Write byte j of element i of src to dst[j * n + i] (n = len(src) // element_size).\n"
"src and dst are contiguous buffers of one length, a multiple of element_size;\n"
"dst is writable and must not overlap src.");

static PyObject *planes_split(PyObject *self, PyObject *args)
{
    Py_buffer src, dst;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "y*w*n", &src, &dst, &size))
        return NULL;
    PyObject *result = NULL;
    if (size < 1 || size > MAX_PLANES || src.len != dst.len || src.len % size) {
        PyErr_Format(PyExc_ValueError, "split needs buffers of one length, a multiple of an"
                     " element size of 1 to %d (got %zd and %zd bytes, size %zd)",
                     MAX_PLANES, src.len, dst.len, size);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    split_elements((const uint8_t *)src.buf, (uint8_t *)dst.buf, src.len / size, size);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

PyDoc_STRVAR(join_doc,
"join(planes, dst)\n\n"
"Write planes[j][i] to dst[i * len(planes) + j]: the inverse of split.\n"
"planes is a sequence of 1 to 64 contiguous buffers of one length n;\n"
"dst is a writable contiguous buffer of n * len(planes) bytes.");

static PyObject *planes_join(PyObject *self, PyObject *args)
{
    PyObject *sequence;
    Py_buffer dst;
    if (!PyArg_ParseTuple(args, "Ow*", &sequence, &dst))
        return NULL;
    PyObject *result = NULL, *items = NULL;
    Py_buffer views[MAX_PLANES];
    const uint8_t *pointers[MAX_PLANES];
    Py_ssize_t held = 0, size = 0, count = 0;
    /* A tuple of its own: the items of a list are borrowed, and a plane's __buffer__
     * (Python 3.12+) could empty the list while its item is still in use. */
    items = PySequence_Tuple(sequence);
    if (items == NULL)
        goto done;
    size = PyTuple_GET_SIZE(items);
    if (size < 1 || size > MAX_PLANES || dst.len % size) {
        PyErr_Format(PyExc_ValueError, "join needs 1 to %d planes whose count divides the"
                     " output (got %zd planes, %zd bytes)", MAX_PLANES, size, dst.len);
        goto done;
    }
    count = dst.len / size;
    for (; held < size; held++) {
        PyObject *item = PyTuple_GET_ITEM(items, held);
        if (PyObject_GetBuffer(item, &views[held], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (views[held].len != count) {
            PyErr_Format(PyExc_ValueError, "plane %zd holds %zd bytes, the output needs %zd",
                         held, views[held].len, count);
            held++;
            goto done;
        }
        pointers[held] = (const uint8_t *)views[held].buf;
    }
    Py_BEGIN_ALLOW_THREADS
    join_elements(pointers, (uint8_t *)dst.buf, count, size);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    Py_XDECREF(items);
    PyBuffer_Release(&dst);
    return result;
}

/* Sub-delta lanes: element_size-byte little-endian unsigned integers. */
#define LANE_LOOPS(bits)                                                          \
    static void zigzag_##bits(const uint8_t *raw, const uint8_t *base, uint8_t *out, \
                              Py_ssize_t count)                                   \
    {                                                                             \
        for (Py_ssize_t i = 0; i < count; i++) {                                  \
            uint##bits##_t a, b;                                                  \
            memcpy(&a, raw + i * (bits / 8), bits / 8);                           \
            memcpy(&b, base + i * (bits / 8), bits / 8);                          \
            uint##bits##_t d = (uint##bits##_t)(a - b);                           \
            uint##bits##_t z = (uint##bits##_t)((uint##bits##_t)(d << 1)          \
                                 ^ (uint##bits##_t)(0u - (d >> (bits - 1))));     \
            memcpy(out + i * (bits / 8), &z, bits / 8);                           \
        }                                                                         \
    }                                                                             \
    /* out = base + unzigzag(image); out may be either input (each element is   \
     * read before it is written). */                                             \
    static void unzigzag_add_##bits(uint8_t *out, const uint8_t *image,           \
                                    const uint8_t *base, Py_ssize_t count)        \
    {                                                                             \
        for (Py_ssize_t i = 0; i < count; i++) {                                  \
            uint##bits##_t z, b;                                                  \
            memcpy(&z, image + i * (bits / 8), bits / 8);                         \
            memcpy(&b, base + i * (bits / 8), bits / 8);                          \
            uint##bits##_t d = (uint##bits##_t)((z >> 1) ^ (uint##bits##_t)(0u - (z & 1u))); \
            uint##bits##_t r = (uint##bits##_t)(b + d);                           \
            memcpy(out + i * (bits / 8), &r, bits / 8);                           \
        }                                                                         \
    }

LANE_LOOPS(8)
LANE_LOOPS(16)
LANE_LOOPS(32)
LANE_LOOPS(64)

/* A sub-delta link applied straight from its decoded planes: out = base +
 * unzigzag(element gathered from the planes), one pass instead of a join and an
 * add.  A block of 64 elements whose image bytes are all zero (what elements a
 * save left alone give: sparse updates leave long runs of them) is a copy of
 * the base's. */
#define JOIN_BLOCK 64
#define JOIN_LANE_LOOP(bits)                                                      \
    static void join_unzigzag_add_##bits(const uint8_t *const *planes,            \
                                         const uint8_t *restrict base,            \
                                         uint8_t *restrict out, Py_ssize_t count) \
    {                                                                             \
        enum { SIZE = bits / 8 };                                                 \
        const uint8_t *p[SIZE]; /* local: the loops below see no aliasing */      \
        for (int k = 0; k < SIZE; k++)                                            \
            p[k] = planes[k];                                                     \
        for (Py_ssize_t start = 0; start < count; start += JOIN_BLOCK) {          \
            Py_ssize_t end = start + JOIN_BLOCK < count ? start + JOIN_BLOCK : count; \
            if (end - start == JOIN_BLOCK) {                                      \
                uint64_t any = 0;                                                 \
                for (int k = 0; k < SIZE; k++)                                    \
                    for (int w = 0; w < JOIN_BLOCK / 8; w++) {                    \
                        uint64_t word;                                            \
                        memcpy(&word, p[k] + start + 8 * w, 8);              \
                        any |= word;                                              \
                    }                                                             \
                if (!any) {                                                       \
                    memcpy(out + start * SIZE, base + start * SIZE, JOIN_BLOCK * SIZE); \
                    continue;                                                     \
                }                                                                 \
            }                                                                     \
            for (Py_ssize_t e = start; e < end; e++) {                            \
                uint##bits##_t z = 0, b;                                          \
                for (int k = 0; k < SIZE; k++)                                    \
                    z |= (uint##bits##_t)((uint##bits##_t)p[k][e] << (8 * k)); \
                memcpy(&b, base + e * SIZE, SIZE);                                \
                uint##bits##_t r = (uint##bits##_t)(b + (uint##bits##_t)(         \
                    (z >> 1) ^ (uint##bits##_t)(0u - (z & 1u))));                 \
                memcpy(out + e * SIZE, &r, SIZE);                                 \
            }                                                                     \
        }                                                                         \
    }

JOIN_LANE_LOOP(8)
JOIN_LANE_LOOP(16)
JOIN_LANE_LOOP(32)
JOIN_LANE_LOOP(64)

static int lane_lengths(Py_ssize_t size, Py_ssize_t a, Py_ssize_t b, Py_ssize_t c)
{
    if ((size != 1 && size != 2 && size != 4 && size != 8) || a != b || a != c || a % size) {
        PyErr_Format(PyExc_ValueError, "sub-delta needs buffers of one length, whole"
                     " elements of 1, 2, 4 or 8 bytes (got %zd, %zd and %zd bytes, size %zd)",
                     a, b, c, size);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(zigzag_doc,
"zigzag_delta(raw, base, out, element_size)\n\n"
"out = zigzag(raw - base), element by element, as little-endian unsigned integers of\n"
"element_size (1, 2, 4 or 8) bytes, the difference taken modulo 2^(8 x element_size):\n"
"0, -1, 1, -2, ... become 0, 1, 2, 3, ...  All three buffers contiguous, of one length.");

static PyObject *native_zigzag_delta(PyObject *self, PyObject *args)
{
    Py_buffer raw, base, out;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "y*y*w*n", &raw, &base, &out, &size))
        return NULL;
    PyObject *result = NULL;
    if (lane_lengths(size, raw.len, base.len, out.len)) {
        const uint8_t *r = raw.buf, *b = base.buf;
        uint8_t *o = out.buf;
        Py_ssize_t count = raw.len / size;
        Py_BEGIN_ALLOW_THREADS
        switch (size) {
        case 1: zigzag_8(r, b, o, count); break;
        case 2: zigzag_16(r, b, o, count); break;
        case 4: zigzag_32(r, b, o, count); break;
        default: zigzag_64(r, b, o, count); break;
        }
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&raw);
    PyBuffer_Release(&base);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(unzigzag_doc,
"unzigzag_add(image, base, element_size)\n\n"
"image = base + unzigzag(image), in place: the inverse of zigzag_delta.");

static PyObject *native_unzigzag_add(PyObject *self, PyObject *args)
{
    Py_buffer image, base;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "w*y*n", &image, &base, &size))
        return NULL;
    PyObject *result = NULL;
    if (lane_lengths(size, image.len, base.len, base.len)) {
        uint8_t *im = image.buf;
        const uint8_t *b = base.buf;
        Py_ssize_t count = image.len / size;
        Py_BEGIN_ALLOW_THREADS
        switch (size) {
        case 1: unzigzag_add_8(im, im, b, count); break;
        case 2: unzigzag_add_16(im, im, b, count); break;
        case 4: unzigzag_add_32(im, im, b, count); break;
        default: unzigzag_add_64(im, im, b, count); break;
        }
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&image);
    PyBuffer_Release(&base);
    return result;
}

PyDoc_STRVAR(join_unzigzag_doc,
"join_unzigzag_add(planes, base, out)\n\n"
"out = base + unzigzag(join(planes)), element by element, as unzigzag_add does with\n"
"the joined image, in one pass: len(planes) is the element size (1, 2, 4 or 8),\n"
"each plane holds n bytes, base and out n * len(planes); out overlaps nothing.");

static PyObject *native_join_unzigzag_add(PyObject *self, PyObject *args)
{
    PyObject *sequence;
    Py_buffer base, out;
    if (!PyArg_ParseTuple(args, "Oy*w*", &sequence, &base, &out))
        return NULL;
    PyObject *result = NULL, *items = NULL;
    Py_buffer views[8];
    const uint8_t *pointers[8];
    Py_ssize_t held = 0, size = 0, count = 0;
    items = PySequence_Tuple(sequence);  /* a tuple of its own, as in join */
    if (items == NULL)
        goto done;
    size = PyTuple_GET_SIZE(items);
    if (!lane_lengths(size, out.len, base.len, base.len))
        goto done;
    count = out.len / size;
    for (; held < size; held++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(items, held), &views[held],
                               PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (views[held].len != count) {
            PyErr_Format(PyExc_ValueError, "plane %zd holds %zd bytes, the output needs %zd",
                         held, views[held].len, count);
            held++;
            goto done;
        }
        pointers[held] = (const uint8_t *)views[held].buf;
    }
    {
        const uint8_t *b = base.buf;
        uint8_t *o = out.buf;
        Py_BEGIN_ALLOW_THREADS
        switch (size) {
        case 1: join_unzigzag_add_8(pointers, b, o, count); break;
        case 2: join_unzigzag_add_16(pointers, b, o, count); break;
        case 4: join_unzigzag_add_32(pointers, b, o, count); break;
        default: join_unzigzag_add_64(pointers, b, o, count); break;
        }
        Py_END_ALLOW_THREADS
    }
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    Py_XDECREF(items);
    PyBuffer_Release(&base);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(add_runs_doc,
"unzigzag_add_runs(chunk, starts, counts, values, element_size)\n\n"
"For each run i (starts and counts: int64 buffers of one length), the elements\n"
"starts[i] .. starts[i] + counts[i] of chunk += unzigzag(the next counts[i] elements of\n"
"values), in place; every run within the chunk, counts at least 1, and values exactly\n"
"the runs' elements (ValueError otherwise, with nothing changed).");

static PyObject *native_unzigzag_add_runs(PyObject *self, PyObject *args)
{
    Py_buffer chunk, starts, counts, values;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "w*y*y*y*n", &chunk, &starts, &counts, &values, &size))
        return NULL;
    PyObject *result = NULL;
    const int64_t *s = starts.buf, *c = counts.buf;
    Py_ssize_t runs = starts.len / 8, elements = 0, total = 0;
    if ((size != 1 && size != 2 && size != 4 && size != 8) || chunk.len % size
        || starts.len % 8 || starts.len != counts.len) {
        PyErr_SetString(PyExc_ValueError, "sparse-delta runs need int64 starts and counts"
                        " of one length and whole elements of 1, 2, 4 or 8 bytes");
        goto done;
    }
    elements = chunk.len / size;
    for (Py_ssize_t i = 0; i < runs; i++) {
        if (s[i] < 0 || c[i] < 1 || s[i] > elements || c[i] > elements - s[i]) {
            PyErr_Format(PyExc_ValueError, "sparse-delta run %zd (%lld, %lld elements) is"
                         " outside the chunk of %zd elements", i, (long long)s[i],
                         (long long)c[i], elements);
            goto done;
        }
        total += (Py_ssize_t)c[i];
    }
    if (total * size != values.len) {
        PyErr_Format(PyExc_ValueError, "sparse-delta runs hold %zd elements, the values %zd"
                     " bytes", total, values.len);
        goto done;
    }
    {
        uint8_t *o = chunk.buf;
        const uint8_t *v = values.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < runs; i++) {
            uint8_t *at = o + s[i] * size;
            switch (size) {
            case 1: unzigzag_add_8(at, v, at, c[i]); break;
            case 2: unzigzag_add_16(at, v, at, c[i]); break;
            case 4: unzigzag_add_32(at, v, at, c[i]); break;
            default: unzigzag_add_64(at, v, at, c[i]); break;
            }
            v += c[i] * size;
        }
        Py_END_ALLOW_THREADS
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&chunk);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&values);
    return result;
}

static PyMethodDef native_methods[] = {
    {"split", planes_split, METH_VARARGS, split_doc},
    {"join", planes_join, METH_VARARGS, join_doc},
    {"zigzag_delta", native_zigzag_delta, METH_VARARGS, zigzag_doc},
    {"unzigzag_add", native_unzigzag_add, METH_VARARGS, unzigzag_doc},
    {"join_unzigzag_add", native_join_unzigzag_add, METH_VARARGS, join_unzigzag_doc},
    {"unzigzag_add_runs", native_unzigzag_add_runs, METH_VARARGS, add_runs_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "chunkstore.codecs._native",
    "The codecs' inner loops (see chunkstore.codecs.planes and .subdelta).",
    -1, native_methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    if (!little_endian()) {
        PyErr_SetString(PyExc_ImportError, "chunkstore.codecs._native assumes a"
                        " little-endian host; the numpy fallback is used instead");
        return NULL;
    }
    return PyModule_Create(&native_module);
}
