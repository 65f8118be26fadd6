/* The host kernel of the ``mix64-v3`` fingerprint (format/fingerprint.py defines it).
 *
 * sum over units u of  mix(x(u) ^ key(u))  mod 2**64, where x(u) is the unit's bytes
 * (little-endian, zero-extended), key(u) = u * GOLDEN + SALT and mix is splitmix64's
 * finalizer. A unit is one element, or 8 bytes of an element wider than 8 bytes.
 *
 * One call sums every run of a shard: ``run_sum(data, unit, run_units, starts)`` reads
 * ``len(starts)`` runs of ``run_units`` units each, back to back in ``data``, run ``n``
 * starting at global unit ``starts[n]``. The GIL is released while it runs, so that
 * fingerprinting beside I/O or training uses one core and no thread pool.
 *
 * On x86-64 Linux each loop is built for AVX-512, AVX2 and the baseline and the loader
 * picks one (GCC's target_clones): the arithmetic is the same integer arithmetic, so the
 * sum is the same on every machine. Python's fallback (torch ops) proves it in the tests.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define SALT 0xD1B54A32D192ED03ULL
#define M1 0xBF58476D1CE4E5B9ULL
#define M2 0x94D049BB133111EBULL

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define CLONES
#endif

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= M1;
    x ^= x >> 27;
    x *= M2;
    return x ^ (x >> 31);
}

#define RUN_LOOP(NAME, TYPE)                                                    \
    CLONES static uint64_t NAME(const uint8_t *p, size_t n, uint64_t u0) {     \
        uint64_t s = 0, key = u0 * GOLDEN + SALT; /* key(u0 + i), stepped */    \
        for (size_t i = 0; i < n; i++, key += GOLDEN) {                         \
            TYPE v;                                                             \
            memcpy(&v, p + i * sizeof(TYPE), sizeof(TYPE));                     \
            s += mix((uint64_t)v ^ key);                                        \
        }                                                                       \
        return s;                                                               \
    }

RUN_LOOP(run8, uint8_t)
RUN_LOOP(run16, uint16_t)
RUN_LOOP(run32, uint32_t)
RUN_LOOP(run64, uint64_t)

static PyObject *run_sum(PyObject *self, PyObject *args) {
    Py_buffer data, starts;
    Py_ssize_t unit, run_units;
    if (!PyArg_ParseTuple(args, "y*nny*", &data, &unit, &run_units, &starts))
        return NULL;
    uint64_t (*loop)(const uint8_t *, size_t, uint64_t) = NULL;
    switch (unit) {
    case 1: loop = run8; break;
    case 2: loop = run16; break;
    case 4: loop = run32; break;
    case 8: loop = run64; break;
    }
    Py_ssize_t runs = starts.len / (Py_ssize_t)sizeof(uint64_t);
    if (loop == NULL || run_units < 0 || starts.len % sizeof(uint64_t) ||
        data.len < runs * run_units * unit) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&starts);
        PyErr_SetString(PyExc_ValueError, "run_sum: bad unit size, run length or buffer");
        return NULL;
    }
    uint64_t total = 0;
    const uint8_t *p = (const uint8_t *)data.buf;
    const uint8_t *s = (const uint8_t *)starts.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < runs; r++) {
        uint64_t u0;
        memcpy(&u0, s + r * sizeof(uint64_t), sizeof(uint64_t));
        total += loop(p + r * run_units * unit, (size_t)run_units, u0);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&starts);
    return PyLong_FromUnsignedLongLong(total);
}

static PyMethodDef methods[] = {
    {"run_sum", run_sum, METH_VARARGS,
     "run_sum(data, unit, run_units, starts) -> the mix64-v3 sum of the runs, mod 2**64"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "mix64_kernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit_mix64_kernel(void) { return PyModule_Create(&module); }
