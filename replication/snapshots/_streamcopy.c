/* Copy host bytes into a snapshot slot with non-temporal (streaming) stores.
 *
 * A snapshot slot is written now and read much later (by the replication thread, the
 * durable writer, or a restore), so pulling it through the cache only evicts the
 * training step's own working set and costs a read-for-ownership of every destination
 * line. Streaming stores skip both. glibc's memcpy makes the same choice only above a
 * size threshold tied to the last-level cache, which most per-tensor copies are under.
 *
 * The caller (replication/snapshots/streamcopy.py) checks devices, sizes and contiguity and
 * passes raw addresses; this file only moves bytes, with the GIL released. On other
 * architectures it is a plain memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STREAMCOPY_NONTEMPORAL 1
#else
#define STREAMCOPY_NONTEMPORAL 0
#endif

static void stream_copy(char *dst, const char *src, size_t n)
{
#if STREAMCOPY_NONTEMPORAL
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* streaming stores need 16-byte alignment */
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t lines = n / 64;
    for (size_t i = 0; i < lines; i++) { /* one cache line per iteration */
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)(dst + 0), a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        src += 64;
        dst += 64;
    }
    memcpy(dst, src, n - lines * 64);
    _mm_sfence(); /* order the streaming stores before anything that publishes the slot */
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *py_copy(PyObject *self, PyObject *args)
{
    unsigned long long dst, src;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKn:copy", &dst, &src, &n))
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "copy: negative byte count %zd", n);
        return NULL;
    }
    char *d = (char *)(uintptr_t)dst;
    const char *s = (const char *)(uintptr_t)src;
    if (n > 0 && (d < s + n && s < d + n)) {
        PyErr_SetString(PyExc_ValueError, "copy: source and destination overlap");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    stream_copy(d, s, (size_t)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", py_copy, METH_VARARGS,
     "copy(dst_address, src_address, nbytes): copy with streaming stores, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_streamcopy",
    "Non-temporal byte copy for snapshot slots (see replication/snapshots/streamcopy.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__streamcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "NONTEMPORAL", STREAMCOPY_NONTEMPORAL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
