/* musacache native transfer module. See musacache_native.h for the contract.
 *
 * Design notes (docs/benchmarks.md has the figures behind them):
 *  - Consecutive slots whose rows are adjacent on both sides are merged into one copy ("runs").
 *    The run table is built once per call and shared by every plane and thread.
 *  - Copies larger than the last-level cache use non-temporal stores: the destination will not
 *    be read back soon enough to stay cached, and streaming skips the read-for-ownership.
 *  - SIMD code is compiled per function with target attributes and picked at run time, so the
 *    module needs no -m flags and runs on any x86-64; other architectures use memcpy and
 *    scalar loops that the compiler vectorises for the baseline ISA.
 */
#define _GNU_SOURCE 1

#include "musacache_native.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MC_X86 1
#include <immintrin.h>
#else
#define MC_X86 0
#endif

#ifndef MC_VERSION
#error "MC_VERSION must be defined by the build (src/native/build.py passes the package version)"
#endif

#if defined(__GNUC__) || defined(__clang__)
#define MC_INLINE static inline __attribute__((always_inline))
#define MC_LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define MC_STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#else
#define MC_INLINE static inline
#define MC_LOAD(p) (*(p))
#define MC_STORE(p, v) (*(p) = (v))
#endif

/* Below this many bytes per thread, starting a thread costs more than it saves. */
#define MC_DEFAULT_THREAD_MIN_BYTES ((int64_t)2 << 20)
/* Runs shorter than this are copied with memcpy even in streaming mode: a partial cache line
 * written with non-temporal stores is slower than a cached store. */
#define MC_MIN_STREAM_RUN 256
#define MC_DEFAULT_LLC_BYTES ((int64_t)32 << 20)
#define MC_MAX_THREADS 256

const char *mc_version(void) { return MC_VERSION; }

/* ---------------------------------------------------------------------------------------- */
/* Settings, detected once                                                                   */
/* ---------------------------------------------------------------------------------------- */

static pthread_once_t settings_once = PTHREAD_ONCE_INIT;
static int max_simd_level = MC_SIMD_NONE;
static int simd_level = MC_SIMD_NONE;
static int64_t default_stream_threshold = MC_DEFAULT_LLC_BYTES;
static int64_t stream_threshold = MC_DEFAULT_LLC_BYTES;
static int64_t thread_min_bytes = MC_DEFAULT_THREAD_MIN_BYTES;

static int detect_simd_level(void) {
#if MC_X86
    __builtin_cpu_init();
    /* libgcc/compiler-rt also check that the OS saves the wide registers (XCR0). */
    if (__builtin_cpu_supports("avx512f")) return MC_SIMD_AVX512;
    if (__builtin_cpu_supports("avx2")) return MC_SIMD_AVX2;
    return MC_SIMD_SSE2; /* part of the x86-64 baseline */
#else
    return MC_SIMD_NONE;
#endif
}

/* The last-level cache size from Linux sysfs (what lscpu shows), 0 when unknown. */
static int64_t llc_bytes_from_sysfs(void) {
    int best_level = 0;
    int64_t best_bytes = 0;
    for (int index = 0; index < 16; index++) {
        char path[96];
        int level = 0;
        long long size = 0;
        char unit = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", index);
        FILE *f = fopen(path, "r");
        if (f == NULL) break;
        int got = fscanf(f, "%d", &level);
        fclose(f);
        if (got != 1) continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", index);
        f = fopen(path, "r");
        if (f == NULL) continue;
        got = fscanf(f, "%lld%c", &size, &unit);
        fclose(f);
        if (got < 1 || size <= 0) continue;
        if (got == 2 && (unit == 'K' || unit == 'k')) size <<= 10;
        if (got == 2 && (unit == 'M' || unit == 'm')) size <<= 20;
        if (level > best_level) {
            best_level = level;
            best_bytes = (int64_t)size;
        }
    }
    return best_bytes;
}

static int64_t detect_llc_bytes(void) {
    /* sysfs first: in virtual machines sysconf() often reports the whole socket's L3
     * (hundreds of MiB) while this core complex has a fraction of it. */
    int64_t llc = llc_bytes_from_sysfs();
#ifdef _SC_LEVEL3_CACHE_SIZE
    if (llc <= 0) llc = (int64_t)sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (llc <= 0) llc = (int64_t)sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    if (llc <= 0) return MC_DEFAULT_LLC_BYTES;
    /* Past these bounds the figure no longer predicts when the destination is evicted. */
    if (llc > ((int64_t)128 << 20)) llc = (int64_t)128 << 20;
    if (llc < ((int64_t)4 << 20)) llc = (int64_t)4 << 20;
    return llc;
}

static void init_settings(void) {
    max_simd_level = detect_simd_level();
    MC_STORE(&simd_level, max_simd_level);
    default_stream_threshold = detect_llc_bytes();
    MC_STORE(&stream_threshold, default_stream_threshold);
}

static void ensure_settings(void) { pthread_once(&settings_once, init_settings); }

int mc_has_streaming_stores(int *out) {
    if (out == NULL) return MC_ERR_ARGUMENT;
    ensure_settings();
    *out = max_simd_level >= MC_SIMD_SSE2;
    return MC_OK;
}

int mc_set_streaming_threshold(int64_t nbytes) {
    ensure_settings();
    if (nbytes < -1) return MC_ERR_ARGUMENT;
    MC_STORE(&stream_threshold, nbytes == -1 ? default_stream_threshold : nbytes);
    return MC_OK;
}

int mc_get_streaming_threshold(int64_t *out) {
    if (out == NULL) return MC_ERR_ARGUMENT;
    ensure_settings();
    *out = MC_LOAD(&stream_threshold);
    return MC_OK;
}

int mc_set_thread_min_bytes(int64_t nbytes) {
    if (nbytes < -1) return MC_ERR_ARGUMENT;
    MC_STORE(&thread_min_bytes, nbytes == -1 ? MC_DEFAULT_THREAD_MIN_BYTES : nbytes);
    return MC_OK;
}

int mc_get_thread_min_bytes(int64_t *out) {
    if (out == NULL) return MC_ERR_ARGUMENT;
    *out = MC_LOAD(&thread_min_bytes);
    return MC_OK;
}

int mc_set_simd_level(int level) {
    ensure_settings();
    if (level < MC_SIMD_NONE || level > MC_SIMD_AVX512) return MC_ERR_ARGUMENT;
    MC_STORE(&simd_level, level < max_simd_level ? level : max_simd_level);
    return MC_OK;
}

int mc_get_simd_level(int *out) {
    if (out == NULL) return MC_ERR_ARGUMENT;
    ensure_settings();
    *out = MC_LOAD(&simd_level);
    return MC_OK;
}

int mc_max_simd_level(int *out) {
    if (out == NULL) return MC_ERR_ARGUMENT;
    ensure_settings();
    *out = max_simd_level;
    return MC_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Copy kernels                                                                              */
/* ---------------------------------------------------------------------------------------- */

typedef void (*copy_fn)(char *dst, const char *src, size_t n);

static void copy_cached(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }

#if MC_X86
/* Each streaming kernel stores the unaligned head and the tail with memcpy and streams the
 * aligned middle. The caller issues one sfence after all of its copies. */

static void copy_stream_sse2(char *dst, const char *src, size_t n) {
    size_t head = (size_t)(-(uintptr_t)dst) & 15u;
    if (n < MC_MIN_STREAM_RUN || head >= n) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, src += 64, dst += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(const void *)(src + 48));
        _mm_stream_si128((__m128i *)(void *)dst, a);
        _mm_stream_si128((__m128i *)(void *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(void *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(void *)(dst + 48), d);
    }
    for (; n >= 16; n -= 16, src += 16, dst += 16) {
        _mm_stream_si128((__m128i *)(void *)dst,
                         _mm_loadu_si128((const __m128i *)(const void *)src));
    }
    memcpy(dst, src, n);
}

__attribute__((target("avx2"))) static void copy_stream_avx2(char *dst, const char *src,
                                                             size_t n) {
    size_t head = (size_t)(-(uintptr_t)dst) & 31u;
    if (n < MC_MIN_STREAM_RUN || head >= n) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 128; n -= 128, src += 128, dst += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(const void *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(const void *)(src + 96));
        _mm256_stream_si256((__m256i *)(void *)dst, a);
        _mm256_stream_si256((__m256i *)(void *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(void *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(void *)(dst + 96), d);
    }
    for (; n >= 32; n -= 32, src += 32, dst += 32) {
        _mm256_stream_si256((__m256i *)(void *)dst,
                            _mm256_loadu_si256((const __m256i *)(const void *)src));
    }
    memcpy(dst, src, n);
}

__attribute__((target("avx512f"))) static void copy_stream_avx512(char *dst, const char *src,
                                                                  size_t n) {
    size_t head = (size_t)(-(uintptr_t)dst) & 63u;
    if (n < MC_MIN_STREAM_RUN || head >= n) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 256; n -= 256, src += 256, dst += 256) {
        __m512i a = _mm512_loadu_si512((const void *)src);
        __m512i b = _mm512_loadu_si512((const void *)(src + 64));
        __m512i c = _mm512_loadu_si512((const void *)(src + 128));
        __m512i d = _mm512_loadu_si512((const void *)(src + 192));
        _mm512_stream_si512((void *)dst, a);
        _mm512_stream_si512((void *)(dst + 64), b);
        _mm512_stream_si512((void *)(dst + 128), c);
        _mm512_stream_si512((void *)(dst + 192), d);
    }
    for (; n >= 64; n -= 64, src += 64, dst += 64) {
        _mm512_stream_si512((void *)dst, _mm512_loadu_si512((const void *)src));
    }
    memcpy(dst, src, n);
}
#endif /* MC_X86 */

static copy_fn pick_copy(int64_t total_bytes) {
    ensure_settings();
    if (total_bytes <= MC_LOAD(&stream_threshold)) return copy_cached;
#if MC_X86
    switch (MC_LOAD(&simd_level)) {
    case MC_SIMD_AVX512:
        return copy_stream_avx512;
    case MC_SIMD_AVX2:
        return copy_stream_avx2;
    case MC_SIMD_SSE2:
        return copy_stream_sse2;
    default:
        return copy_cached;
    }
#else
    return copy_cached;
#endif
}

static void store_fence(copy_fn fn) {
#if MC_X86
    /* Streaming stores are weakly ordered: fence them before the data is handed over. */
    if (fn != copy_cached) _mm_sfence();
#else
    (void)fn;
#endif
}

/* ---------------------------------------------------------------------------------------- */
/* Paged <-> dense rows                                                                      */
/* ---------------------------------------------------------------------------------------- */

typedef struct run {
    int64_t paged_off;
    int64_t dense_off; /* from the run's chunk's dense plane */
    int64_t nbytes;
    int64_t chunk;
} run;

typedef struct work {
    const mc_row_copy *copy;
    const run *runs;
    const int64_t *seg_bounds; /* segment s covers runs [seg_bounds[s], seg_bounds[s + 1]) */
    int64_t num_segs;
    int64_t unit_begin; /* units are (plane, segment) pairs, plane-major */
    int64_t unit_end;
    int to_dense;
    copy_fn copy_fn;
} work;

static int64_t num_chunks_of(const mc_row_copy *c) {
    return c->num_chunks > 1 ? c->num_chunks : 1;
}

static int check_row_copy(const mc_row_copy *c) {
    if (c == NULL) return MC_ERR_ARGUMENT;
    if (c->num_planes < 0 || c->row_bytes < 0 || c->num_tokens < 0 || c->num_slots < 0)
        return MC_ERR_ARGUMENT;
    if (c->block_size <= 0 || c->block_stride < 0 || c->slot_stride < 0 ||
        c->dense_row_stride < 0)
        return MC_ERR_ARGUMENT;
    if (c->num_planes > 0 && (c->paged_planes == NULL || c->dense_planes == NULL))
        return MC_ERR_ARGUMENT;
    if (c->num_tokens > 0 && c->slots == NULL) return MC_ERR_ARGUMENT;
    if (c->num_chunks < 0 || (c->num_chunks > 1 && c->chunk_starts == NULL))
        return MC_ERR_ARGUMENT;
    int64_t num_chunks = num_chunks_of(c);
    if (c->chunk_starts != NULL) {
        if (c->chunk_starts[0] != 0 || c->chunk_starts[num_chunks] != c->num_tokens)
            return MC_ERR_ARGUMENT;
        for (int64_t k = 0; k < num_chunks; k++) {
            if (c->chunk_starts[k + 1] < c->chunk_starts[k]) return MC_ERR_ARGUMENT;
        }
    }
    for (int64_t p = 0; p < c->num_planes; p++) {
        if (c->paged_planes[p] == NULL) return MC_ERR_ARGUMENT;
    }
    for (int64_t p = 0; p < c->num_planes * num_chunks; p++) {
        if (c->dense_planes[p] == NULL) return MC_ERR_ARGUMENT;
    }
    return MC_OK;
}

/* Validates every slot, then merges tokens into runs; writes nothing to the planes. */
static int build_runs(const mc_row_copy *c, run *runs, int64_t *num_runs) {
    const int64_t *slots = c->slots;
    for (int64_t t = 0; t < c->num_tokens; t++) {
        if (slots[t] < -1 || slots[t] >= c->num_slots) return MC_ERR_SLOT_RANGE;
    }
    int64_t n = 0;
    int64_t chunk = 0, chunk_start = 0;
    int64_t chunk_end = c->chunk_starts != NULL ? c->chunk_starts[1] : c->num_tokens;
    for (int64_t t = 0; t < c->num_tokens; t++) {
        while (t >= chunk_end) { /* empty chunks are stepped over */
            chunk++;
            chunk_start = chunk_end;
            chunk_end = c->chunk_starts[chunk + 1];
        }
        int64_t s = slots[t];
        if (s < 0) continue;
        int64_t paged = (s / c->block_size) * c->block_stride + (s % c->block_size) * c->slot_stride;
        int64_t dense = (t - chunk_start) * c->dense_row_stride;
        if (n > 0) {
            run *last = &runs[n - 1];
            /* A run never crosses chunks: the next chunk's rows live in other buffers. */
            if (last->chunk == chunk && last->paged_off + last->nbytes == paged &&
                last->dense_off + last->nbytes == dense) {
                last->nbytes += c->row_bytes;
                continue;
            }
        }
        runs[n].paged_off = paged;
        runs[n].dense_off = dense;
        runs[n].nbytes = c->row_bytes;
        runs[n].chunk = chunk;
        n++;
    }
    *num_runs = n;
    return MC_OK;
}

/* The source of each run starts at a random place, where the hardware prefetcher has no
 * stream yet; asking for the head of the next run while the current one copies hides part
 * of that miss (about 8% on a 2 GiB cache with 32 KiB runs). */
#define MC_PREFETCH_BYTES 1024

static void prefetch_run_head(const work *w, const char *paged, int64_t plane,
                              const run *next) {
#if defined(__GNUC__) || defined(__clang__)
    const mc_row_copy *c = w->copy;
    const char *src = w->to_dense
        ? paged + next->paged_off
        : c->dense_planes[next->chunk * c->num_planes + plane] + next->dense_off;
    int64_t n = next->nbytes < MC_PREFETCH_BYTES ? next->nbytes : MC_PREFETCH_BYTES;
    for (int64_t off = 0; off < n; off += 64) __builtin_prefetch(src + off, 0, 3);
#else
    (void)w, (void)paged, (void)plane, (void)next;
#endif
}

static void do_work(const work *w) {
    const mc_row_copy *c = w->copy;
    for (int64_t u = w->unit_begin; u < w->unit_end; u++) {
        int64_t plane = u / w->num_segs;
        int64_t seg = u % w->num_segs;
        char *paged = c->paged_planes[plane];
        int64_t last = w->seg_bounds[seg + 1];
        for (int64_t r = w->seg_bounds[seg]; r < last; r++) {
            const run *rn = &w->runs[r];
            char *dense = c->dense_planes[rn->chunk * c->num_planes + plane];
            if (r + 1 < last) prefetch_run_head(w, paged, plane, &w->runs[r + 1]);
            if (w->to_dense)
                w->copy_fn(dense + rn->dense_off, paged + rn->paged_off, (size_t)rn->nbytes);
            else
                w->copy_fn(paged + rn->paged_off, dense + rn->dense_off, (size_t)rn->nbytes);
        }
    }
    store_fence(w->copy_fn);
}

static void *work_thread(void *arg) {
    do_work((const work *)arg);
    return NULL;
}

/* Splits the run list into num_segs pieces of about equal bytes. */
static void split_runs(const run *runs, int64_t num_runs, int64_t plane_bytes, int64_t num_segs,
                       int64_t *bounds) {
    int64_t r = 0, acc = 0;
    bounds[0] = 0;
    for (int64_t s = 1; s < num_segs; s++) {
        int64_t target = plane_bytes * s / num_segs;
        while (r < num_runs && acc + runs[r].nbytes <= target) acc += runs[r++].nbytes;
        bounds[s] = r;
    }
    bounds[num_segs] = num_runs;
}

static int transfer_rows(const mc_row_copy *c, int num_threads, int to_dense) {
    int status = check_row_copy(c);
    if (status != MC_OK) return status;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MC_MAX_THREADS) num_threads = MC_MAX_THREADS;
    if (c->num_tokens == 0) return MC_OK;

    run *runs = (run *)malloc((size_t)c->num_tokens * sizeof(run));
    if (runs == NULL) return MC_ERR_NO_MEMORY;
    int64_t num_runs = 0;
    status = build_runs(c, runs, &num_runs);
    if (status != MC_OK || num_runs == 0 || c->num_planes == 0 || c->row_bytes == 0) {
        free(runs);
        return status;
    }

    int64_t plane_bytes = 0;
    for (int64_t r = 0; r < num_runs; r++) plane_bytes += runs[r].nbytes;
    int64_t total_bytes = plane_bytes * c->num_planes;

    int64_t threads = num_threads;
    int64_t min_bytes = MC_LOAD(&thread_min_bytes);
    if (min_bytes > 0) {
        int64_t by_size = total_bytes / min_bytes;
        if (threads > by_size) threads = by_size > 0 ? by_size : 1;
    }
    /* Scatter is split by plane only, so a repeated slot is written in token order. */
    int64_t num_segs = 1;
    if (to_dense && threads > c->num_planes) {
        num_segs = (threads + c->num_planes - 1) / c->num_planes;
        if (num_segs > num_runs) num_segs = num_runs;
    }
    int64_t num_units = c->num_planes * num_segs;
    if (threads > num_units) threads = num_units;

    int64_t *bounds = (int64_t *)malloc((size_t)(num_segs + 1) * sizeof(int64_t));
    work *works = (work *)malloc((size_t)threads * sizeof(work));
    pthread_t *tids = (pthread_t *)malloc((size_t)threads * sizeof(pthread_t));
    if (bounds == NULL || works == NULL || tids == NULL) {
        free(bounds);
        free(works);
        free(tids);
        free(runs);
        return MC_ERR_NO_MEMORY;
    }
    split_runs(runs, num_runs, plane_bytes, num_segs, bounds);

    copy_fn fn = pick_copy(total_bytes);
    for (int64_t i = 0; i < threads; i++) {
        works[i].copy = c;
        works[i].runs = runs;
        works[i].seg_bounds = bounds;
        works[i].num_segs = num_segs;
        works[i].unit_begin = num_units * i / threads;
        works[i].unit_end = num_units * (i + 1) / threads;
        works[i].to_dense = to_dense;
        works[i].copy_fn = fn;
    }

    /* The calling thread does share 0. A thread that fails to start has its share done here
     * too, so running out of threads slows the copy down but never fails it. */
    int started[MC_MAX_THREADS];
    for (int64_t i = 1; i < threads; i++) {
        started[i] = pthread_create(&tids[i], NULL, work_thread, &works[i]) == 0;
    }
    do_work(&works[0]);
    for (int64_t i = 1; i < threads; i++) {
        if (started[i])
            pthread_join(tids[i], NULL);
        else
            do_work(&works[i]);
    }

    free(tids);
    free(works);
    free(bounds);
    free(runs);
    return MC_OK;
}

int mc_gather_rows(const mc_row_copy *copy, int num_threads) {
    return transfer_rows(copy, num_threads, 1);
}

int mc_scatter_rows(const mc_row_copy *copy, int num_threads) {
    return transfer_rows(copy, num_threads, 0);
}

/* ---------------------------------------------------------------------------------------- */
/* Byte-shuffle                                                                              */
/* ---------------------------------------------------------------------------------------- */

/* The loop bodies are written once, scalar and branch-free, and inlined into one function per
 * target so the compiler vectorises each for its ISA. Byte accesses keep them free of
 * alignment assumptions. */

MC_INLINE void shuffle2_body(const uint8_t *restrict src, uint8_t *restrict dst, size_t n) {
    uint8_t *restrict p0 = dst;
    uint8_t *restrict p1 = dst + n;
    for (size_t i = 0; i < n; i++) {
        p0[i] = src[2 * i];
        p1[i] = src[2 * i + 1];
    }
}

MC_INLINE void unshuffle2_body(const uint8_t *restrict src, uint8_t *restrict dst, size_t n) {
    const uint8_t *restrict p0 = src;
    const uint8_t *restrict p1 = src + n;
    for (size_t i = 0; i < n; i++) {
        dst[2 * i] = p0[i];
        dst[2 * i + 1] = p1[i];
    }
}

MC_INLINE void shuffle4_body(const uint8_t *restrict src, uint8_t *restrict dst, size_t n) {
    uint8_t *restrict p0 = dst;
    uint8_t *restrict p1 = dst + n;
    uint8_t *restrict p2 = dst + 2 * n;
    uint8_t *restrict p3 = dst + 3 * n;
    for (size_t i = 0; i < n; i++) {
        p0[i] = src[4 * i];
        p1[i] = src[4 * i + 1];
        p2[i] = src[4 * i + 2];
        p3[i] = src[4 * i + 3];
    }
}

MC_INLINE void unshuffle4_body(const uint8_t *restrict src, uint8_t *restrict dst, size_t n) {
    const uint8_t *restrict p0 = src;
    const uint8_t *restrict p1 = src + n;
    const uint8_t *restrict p2 = src + 2 * n;
    const uint8_t *restrict p3 = src + 3 * n;
    for (size_t i = 0; i < n; i++) {
        dst[4 * i] = p0[i];
        dst[4 * i + 1] = p1[i];
        dst[4 * i + 2] = p2[i];
        dst[4 * i + 3] = p3[i];
    }
}

MC_INLINE void shuffle8_body(const uint8_t *restrict src, uint8_t *restrict dst, size_t n) {
    for (size_t i = 0; i < n; i++) {
        for (size_t j = 0; j < 8; j++) dst[j * n + i] = src[8 * i + j];
    }
}

MC_INLINE void unshuffle8_body(const uint8_t *restrict src, uint8_t *restrict dst, size_t n) {
    for (size_t i = 0; i < n; i++) {
        for (size_t j = 0; j < 8; j++) dst[8 * i + j] = src[j * n + i];
    }
}

/* Any other element size: transpose in blocks that stay in L1. */
#define MC_SHUFFLE_BLOCK 256

static void shuffle_generic(const uint8_t *restrict src, uint8_t *restrict dst, size_t n,
                            size_t k) {
    for (size_t i0 = 0; i0 < n; i0 += MC_SHUFFLE_BLOCK) {
        size_t i1 = i0 + MC_SHUFFLE_BLOCK < n ? i0 + MC_SHUFFLE_BLOCK : n;
        for (size_t j = 0; j < k; j++) {
            uint8_t *restrict plane = dst + j * n;
            for (size_t i = i0; i < i1; i++) plane[i] = src[i * k + j];
        }
    }
}

static void unshuffle_generic(const uint8_t *restrict src, uint8_t *restrict dst, size_t n,
                              size_t k) {
    for (size_t i0 = 0; i0 < n; i0 += MC_SHUFFLE_BLOCK) {
        size_t i1 = i0 + MC_SHUFFLE_BLOCK < n ? i0 + MC_SHUFFLE_BLOCK : n;
        for (size_t j = 0; j < k; j++) {
            const uint8_t *restrict plane = src + j * n;
            for (size_t i = i0; i < i1; i++) dst[i * k + j] = plane[i];
        }
    }
}

typedef void (*shuffle_fn)(const uint8_t *restrict, uint8_t *restrict, size_t);

static void shuffle2_base(const uint8_t *restrict s, uint8_t *restrict d, size_t n) {
    shuffle2_body(s, d, n);
}
static void unshuffle2_base(const uint8_t *restrict s, uint8_t *restrict d, size_t n) {
    unshuffle2_body(s, d, n);
}
static void shuffle4_base(const uint8_t *restrict s, uint8_t *restrict d, size_t n) {
    shuffle4_body(s, d, n);
}
static void unshuffle4_base(const uint8_t *restrict s, uint8_t *restrict d, size_t n) {
    unshuffle4_body(s, d, n);
}
static void shuffle8_base(const uint8_t *restrict s, uint8_t *restrict d, size_t n) {
    shuffle8_body(s, d, n);
}
static void unshuffle8_base(const uint8_t *restrict s, uint8_t *restrict d, size_t n) {
    unshuffle8_body(s, d, n);
}

#if MC_X86
__attribute__((target("avx2"))) static void shuffle2_avx2(const uint8_t *restrict s,
                                                          uint8_t *restrict d, size_t n) {
    shuffle2_body(s, d, n);
}
__attribute__((target("avx2"))) static void unshuffle2_avx2(const uint8_t *restrict s,
                                                            uint8_t *restrict d, size_t n) {
    unshuffle2_body(s, d, n);
}
__attribute__((target("avx2"))) static void shuffle4_avx2(const uint8_t *restrict s,
                                                          uint8_t *restrict d, size_t n) {
    shuffle4_body(s, d, n);
}
__attribute__((target("avx2"))) static void unshuffle4_avx2(const uint8_t *restrict s,
                                                            uint8_t *restrict d, size_t n) {
    unshuffle4_body(s, d, n);
}
__attribute__((target("avx2"))) static void shuffle8_avx2(const uint8_t *restrict s,
                                                          uint8_t *restrict d, size_t n) {
    shuffle8_body(s, d, n);
}
__attribute__((target("avx2"))) static void unshuffle8_avx2(const uint8_t *restrict s,
                                                            uint8_t *restrict d, size_t n) {
    unshuffle8_body(s, d, n);
}
#endif

static shuffle_fn pick_shuffle(int64_t itemsize, int forward) {
    ensure_settings();
#if MC_X86
    if (MC_LOAD(&simd_level) >= MC_SIMD_AVX2) {
        if (itemsize == 2) return forward ? shuffle2_avx2 : unshuffle2_avx2;
        if (itemsize == 4) return forward ? shuffle4_avx2 : unshuffle4_avx2;
        if (itemsize == 8) return forward ? shuffle8_avx2 : unshuffle8_avx2;
    }
#endif
    if (itemsize == 2) return forward ? shuffle2_base : unshuffle2_base;
    if (itemsize == 4) return forward ? shuffle4_base : unshuffle4_base;
    if (itemsize == 8) return forward ? shuffle8_base : unshuffle8_base;
    return NULL;
}

static int check_shuffle_args(const uint8_t *src, const uint8_t *dst, int64_t nbytes,
                              int64_t itemsize) {
    if (nbytes < 0 || itemsize < 1) return MC_ERR_ARGUMENT;
    if (nbytes > 0 && (src == NULL || dst == NULL)) return MC_ERR_ARGUMENT;
    /* The planes are written while the source is still being read. */
    if (nbytes > 0 && src < dst + nbytes && dst < src + nbytes) return MC_ERR_ARGUMENT;
    return MC_OK;
}

static int shuffle_common(const uint8_t *src, uint8_t *dst, int64_t nbytes, int64_t itemsize,
                          int forward) {
    int status = check_shuffle_args(src, dst, nbytes, itemsize);
    if (status != MC_OK || nbytes == 0) return status;
    size_t n = (size_t)(nbytes / itemsize);
    size_t whole = n * (size_t)itemsize;
    if (itemsize == 1 || n == 0) {
        memcpy(dst, src, (size_t)nbytes);
        return MC_OK;
    }
    shuffle_fn fn = pick_shuffle(itemsize, forward);
    if (fn != NULL)
        fn(src, dst, n);
    else if (forward)
        shuffle_generic(src, dst, n, (size_t)itemsize);
    else
        unshuffle_generic(src, dst, n, (size_t)itemsize);
    memcpy(dst + whole, src + whole, (size_t)nbytes - whole);
    return MC_OK;
}

int mc_shuffle(const uint8_t *src, uint8_t *dst, int64_t nbytes, int64_t itemsize) {
    return shuffle_common(src, dst, nbytes, itemsize, 1);
}

int mc_unshuffle(const uint8_t *src, uint8_t *dst, int64_t nbytes, int64_t itemsize) {
    return shuffle_common(src, dst, nbytes, itemsize, 0);
}

/* ---------------------------------------------------------------------------------------- */
/* CRC-32C                                                                                   */
/* ---------------------------------------------------------------------------------------- */

/* The checksum of the chunk format's tagged blocks. The SSE4.2 instruction runs at about
 * 8 bytes per 3 cycles on one stream, twice zlib.crc32 here; other CPUs use slicing-by-8. */

#define MC_CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
static uint32_t crc_table[8][256];
static int have_sse42 = 0;
static int have_vpclmul = 0; /* AVX-512 with the 512-bit carry-less multiply */
#if MC_X86
static void init_fold_constants(void); /* at the end */
#endif

static void init_crc(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ MC_CRC32C_POLY : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
    }
#if MC_X86
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    have_vpclmul = have_sse42 && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("vpclmulqdq");
    if (have_vpclmul) init_fold_constants();
#endif
}

MC_INLINE uint64_t load_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int k = 0; k < 8; k++) v |= (uint64_t)p[k] << (8 * k);
    return v;
}

static uint32_t crc32c_soft(uint32_t crc, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint64_t v = load_le64(p) ^ crc;
        crc = crc_table[7][v & 0xFF] ^ crc_table[6][(v >> 8) & 0xFF] ^
              crc_table[5][(v >> 16) & 0xFF] ^ crc_table[4][(v >> 24) & 0xFF] ^
              crc_table[3][(v >> 32) & 0xFF] ^ crc_table[2][(v >> 40) & 0xFF] ^
              crc_table[1][(v >> 48) & 0xFF] ^ crc_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xFF];
    return crc;
}

#if MC_X86
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const uint8_t *p,
                                                            size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#endif

#if MC_X86
/* Both at the end. */
static uint32_t crc32c_hw3(uint32_t crc, const uint8_t *p, size_t n);
static uint32_t crc32c_fold512(uint32_t crc, const uint8_t *p, size_t n);
#define MC_CRC_FOLD_MIN 256 /* bytes: the fold's first load; shorter buffers take crc32 */
#endif

/* The raw register update over p[0..n): the fastest path this CPU and the SIMD level allow.
 * Every path gives the same bits. */
static uint32_t crc32c_update(uint32_t crc, const uint8_t *p, size_t n) {
    ensure_settings();
    pthread_once(&crc_once, init_crc);
#if MC_X86
    int level = MC_LOAD(&simd_level);
    if (n >= MC_CRC_FOLD_MIN && have_vpclmul && level >= MC_SIMD_AVX512)
        return crc32c_fold512(crc, p, n);
    if (have_sse42 && level >= MC_SIMD_SSE2) return crc32c_hw3(crc, p, n);
#endif
    return crc32c_soft(crc, p, n);
}

int mc_crc32c(const uint8_t *src, int64_t nbytes, uint32_t seed, uint32_t *out) {
    if (out == NULL || nbytes < 0 || (nbytes > 0 && src == NULL)) return MC_ERR_ARGUMENT;
    *out = ~crc32c_update(~seed, src, (size_t)nbytes);
    return MC_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Nibble table coder                                                                        */
/* ---------------------------------------------------------------------------------------- */

/* A byte histogram picks the 15 most frequent bytes; each byte becomes a 4-bit code and the
 * rest (code 15) go to an exception list with their positions. Gaussian bf16 has about 12
 * distinct high bytes, so the plane halves at several GB/s, where lz4 manages 0.3 GB/s.
 * Decoding maps each code byte to two output bytes through a 256-entry pair table. */

#define MC_NIB_CODES 15
#define MC_NIB_ESCAPE 15
#define MC_NIB_MAX_N ((int64_t)INT32_MAX)

MC_INLINE void store_le32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

MC_INLINE uint32_t load_le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static void histogram(const uint8_t *src, size_t n, uint32_t hist[256]) {
    /* Four tables, so that runs of one byte value do not serialise on one counter. */
    uint32_t h[4][256];
    memset(h, 0, sizeof h);
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        h[0][src[i]]++;
        h[1][src[i + 1]]++;
        h[2][src[i + 2]]++;
        h[3][src[i + 3]]++;
    }
    for (; i < n; i++) h[0][src[i]]++;
    for (int b = 0; b < 256; b++) hist[b] = h[0][b] + h[1][b] + h[2][b] + h[3][b];
}

/* The up to 15 most frequent byte values with a non-zero count (ties: the smaller value), and
 * how many bytes they cover. */
static int pick_book(const uint32_t hist[256], uint8_t book[MC_NIB_CODES], uint64_t *covered) {
    uint8_t taken[256];
    memset(taken, 0, sizeof taken);
    memset(book, 0, MC_NIB_CODES);
    int nbook = 0;
    *covered = 0;
    for (; nbook < MC_NIB_CODES; nbook++) {
        int best = -1;
        for (int b = 0; b < 256; b++) {
            if (!taken[b] && hist[b] > 0 && (best < 0 || hist[b] > hist[best])) best = b;
        }
        if (best < 0) break;
        taken[best] = 1;
        book[nbook] = (uint8_t)best;
        *covered += hist[best];
    }
    return nbook;
}

MC_INLINE int64_t nib_size(int64_t n, int64_t escapes) {
    return MC_NIB_OVERHEAD + (n + 1) / 2 + 5 * escapes;
}

/* A block is first judged on a sample from its start: a plane of noise (the mantissa bytes)
 * is rejected after one sample histogram instead of a full one. */
#define MC_NIB_SAMPLE ((size_t)32 << 10)

#if MC_X86
/* codes[i] = code(src[2i]) | code(src[2i+1]) << 4 for the first 32*k pairs; returns how many
 * pairs it did. A byte matches at most one book entry (entries are distinct), so
 * code = 15 ^ (15 ^ k) for the matching k, and 15 when none matches. */
__attribute__((target("avx2"))) static size_t nib_codes_avx2(const uint8_t *src, size_t pairs,
                                                             const uint8_t *book, int nbook,
                                                             uint8_t *codes) {
    __m256i keys[MC_NIB_CODES], flips[MC_NIB_CODES];
    for (int k = 0; k < nbook; k++) {
        keys[k] = _mm256_set1_epi8((char)book[k]);
        flips[k] = _mm256_set1_epi8((char)(MC_NIB_ESCAPE ^ k));
    }
    const __m256i fifteen = _mm256_set1_epi8(MC_NIB_ESCAPE);
    const __m256i low = _mm256_set1_epi16(0x00FF);
    size_t i = 0;
    for (; i + 32 <= pairs; i += 32) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(src + 2 * i));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(src + 2 * i + 32));
        __m256i c0 = fifteen, c1 = fifteen;
        for (int k = 0; k < nbook; k++) {
            c0 = _mm256_xor_si256(c0, _mm256_and_si256(_mm256_cmpeq_epi8(x0, keys[k]), flips[k]));
            c1 = _mm256_xor_si256(c1, _mm256_and_si256(_mm256_cmpeq_epi8(x1, keys[k]), flips[k]));
        }
        /* Per 16-bit lane (even code e in the low byte, odd code o in the high byte):
         * (lane | lane >> 4) & 0xFF = e | o << 4. */
        c0 = _mm256_and_si256(_mm256_or_si256(c0, _mm256_srli_epi16(c0, 4)), low);
        c1 = _mm256_and_si256(_mm256_or_si256(c1, _mm256_srli_epi16(c1, 4)), low);
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(c0, c1), 0xD8);
        _mm256_storeu_si256((__m256i *)(codes + i), packed);
    }
    return i;
}

/* dst[2i], dst[2i+1] = book[low nibble], book[high nibble] of codes[i] (code 15 gives 0) for
 * the first 32*k code bytes; adds the number of code-15 nibbles to *escapes. */
__attribute__((target("avx2"))) static size_t nib_decode_avx2(const uint8_t *codes, size_t pairs,
                                                              const uint8_t *book, uint8_t *dst,
                                                              uint64_t *escapes) {
    uint8_t table[16];
    memcpy(table, book, MC_NIB_CODES);
    table[MC_NIB_ESCAPE] = 0;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i fifteen = _mm256_set1_epi8(MC_NIB_ESCAPE);
    uint64_t found = 0;
    size_t i = 0;
    for (; i + 32 <= pairs; i += 32) {
        __m256i c = _mm256_loadu_si256((const __m256i *)(codes + i));
        __m256i lo = _mm256_and_si256(c, nib);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), nib);
        uint32_t mlo = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(lo, fifteen));
        uint32_t mhi = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(hi, fifteen));
        found += (uint64_t)__builtin_popcount(mlo) + (uint64_t)__builtin_popcount(mhi);
        __m256i vlo = _mm256_shuffle_epi8(lut, lo);
        __m256i vhi = _mm256_shuffle_epi8(lut, hi);
        __m256i a = _mm256_unpacklo_epi8(vlo, vhi); /* codes 0-7 | 16-23 */
        __m256i b = _mm256_unpackhi_epi8(vlo, vhi); /* codes 8-15 | 24-31 */
        _mm256_storeu_si256((__m256i *)(dst + 2 * i), _mm256_permute2x128_si256(a, b, 0x20));
        _mm256_storeu_si256((__m256i *)(dst + 2 * i + 32), _mm256_permute2x128_si256(a, b, 0x31));
    }
    *escapes += found;
    return i;
}
#endif

/* The book comes from a sample of the block (8 slices spread over it), so encoding reads the
 * block once; a byte the sample missed is only an escape, never an error. */
static void sample_histogram(const uint8_t *src, size_t n, uint32_t hist[256]) {
    if (n < 4 * MC_NIB_SAMPLE) {
        histogram(src, n, hist);
        return;
    }
    uint32_t part[256];
    size_t slice = MC_NIB_SAMPLE / 8;
    memset(hist, 0, 256 * sizeof(uint32_t));
    for (size_t k = 0; k < 8; k++) {
        histogram(src + (n - slice) / 7 * k, slice, part);
        for (int b = 0; b < 256; b++) hist[b] += part[b];
    }
}

int mc_nib_encode(const uint8_t *src, int64_t n, uint8_t *dst, int64_t cap, int64_t *out_len) {
    if (out_len == NULL || n < 0 || n > MC_NIB_MAX_N || cap < n) return MC_ERR_ARGUMENT;
    if (n > 0 && (src == NULL || dst == NULL)) return MC_ERR_ARGUMENT;
    if (n > 0 && src < dst + cap && dst < src + n) return MC_ERR_ARGUMENT;
    /* The most escapes that still leave the coded block smaller than n. */
    int64_t room = n - 1 - nib_size(n, 0);
    if (room < 0) return MC_ERR_NO_GAIN;
    size_t max_escapes = (size_t)(room / 5);
    uint32_t hist[256];
    uint8_t book[MC_NIB_CODES];
    uint64_t covered;
    size_t un = (size_t)n;
    ensure_settings();
    sample_histogram(src, un, hist);
    int nbook = pick_book(hist, book, &covered);
    uint64_t sampled = un < 4 * MC_NIB_SAMPLE ? un : MC_NIB_SAMPLE / 8 * 8;
    /* Escapes cost 5 bytes against the 0.5 a code saves. When the sample is the block its
     * escape count is exact, so give up unless the block shrinks; when it is a sample, give
     * up unless it says the block would shrink by an eighth. */
    int64_t sample_size = nib_size((int64_t)sampled, (int64_t)(sampled - covered));
    if (sampled == un ? sample_size >= n : (uint64_t)sample_size * 8 > sampled * 7)
        return MC_ERR_NO_GAIN;

    uint8_t map[256];
    memset(map, MC_NIB_ESCAPE, sizeof map);
    for (int k = 0; k < MC_NIB_CODES; k++) {
        if (hist[book[k]] > 0) map[book[k]] = (uint8_t)k;
    }
    uint8_t *codes = dst + MC_NIB_OVERHEAD;
    size_t pairs = un / 2, ncodes = (un + 1) / 2;
    size_t done = 0;
#if MC_X86
    if (MC_LOAD(&simd_level) >= MC_SIMD_AVX2) done = nib_codes_avx2(src, pairs, book, nbook, codes);
#endif
    for (size_t i = done; i < pairs; i++)
        codes[i] = (uint8_t)(map[src[2 * i]] | (map[src[2 * i + 1]] << 4));
    if (un & 1) codes[pairs] = map[src[un - 1]];
    /* Escapes are rare: find them 8 code bytes at a time (a nibble of all ones). */
    uint8_t *rec = codes + ncodes;
    size_t e = 0;
    for (size_t w = 0; w < ncodes; w += 8) {
        size_t end = w + 8 < ncodes ? w + 8 : ncodes;
        if (end - w == 8) {
            uint64_t v = load_le64(codes + w);
            if ((v & (v >> 1) & (v >> 2) & (v >> 3) & 0x1111111111111111ull) == 0) continue;
        }
        for (size_t i = 2 * w; i < 2 * end && i < un; i++) {
            uint8_t byte = src[i];
            if (map[byte] != MC_NIB_ESCAPE) continue;
            if (e == max_escapes) return MC_ERR_NO_GAIN;
            store_le32(rec + 5 * e, (uint32_t)i);
            rec[5 * e + 4] = byte;
            e++;
        }
    }
    memcpy(dst, book, MC_NIB_CODES);
    dst[MC_NIB_CODES] = 0;
    store_le32(dst + 16, (uint32_t)e);
    *out_len = nib_size(n, (int64_t)e);
    return MC_OK;
}

int mc_nib_decode(const uint8_t *src, int64_t len, uint8_t *dst, int64_t n) {
    if (n < 0 || n > MC_NIB_MAX_N || len < 0) return MC_ERR_ARGUMENT;
    if ((len > 0 && src == NULL) || (n > 0 && dst == NULL)) return MC_ERR_ARGUMENT;
    if (n > 0 && len > 0 && src < dst + n && dst < src + len) return MC_ERR_ARGUMENT;
    if (len < MC_NIB_OVERHEAD || src[MC_NIB_CODES] != 0) return MC_ERR_CORRUPT;
    int64_t escapes = (int64_t)load_le32(src + 16);
    if (escapes > n || nib_size(n, escapes) != len) return MC_ERR_CORRUPT;
    size_t un = (size_t)n;
    const uint8_t *book = src;
    const uint8_t *codes = src + MC_NIB_OVERHEAD;
    const uint8_t *rec = codes + (un + 1) / 2;

    uint8_t pair[256][2];
    uint8_t esc[256];
    for (int c = 0; c < 256; c++) {
        int lo = c & 15, hi = c >> 4;
        pair[c][0] = lo == MC_NIB_ESCAPE ? 0 : book[lo];
        pair[c][1] = hi == MC_NIB_ESCAPE ? 0 : book[hi];
        esc[c] = (uint8_t)((lo == MC_NIB_ESCAPE) + (hi == MC_NIB_ESCAPE));
    }
    size_t pairs = un / 2;
    uint64_t found = 0;
    size_t i0 = 0;
    ensure_settings();
#if MC_X86
    if (MC_LOAD(&simd_level) >= MC_SIMD_AVX2) i0 = nib_decode_avx2(codes, pairs, book, dst, &found);
#endif
    for (size_t i = i0; i < pairs; i++) {
        uint8_t c = codes[i];
        memcpy(dst + 2 * i, pair[c], 2);
        found += esc[c];
    }
    if (un & 1) {
        uint8_t c = codes[pairs];
        if (c >> 4) return MC_ERR_CORRUPT; /* the padding nibble */
        dst[un - 1] = pair[c][0];
        found += esc[c];
    }
    if (found != (uint64_t)escapes) return MC_ERR_CORRUPT;
    int64_t prev = -1;
    for (size_t e = 0; e < (size_t)escapes; e++) {
        int64_t p = (int64_t)load_le32(rec + 5 * e);
        if (p <= prev || p >= n) return MC_ERR_CORRUPT;
        uint8_t code = (uint8_t)((codes[p >> 1] >> ((p & 1) * 4)) & 15);
        if (code != MC_NIB_ESCAPE) return MC_ERR_CORRUPT;
        dst[p] = rec[5 * e + 4];
        prev = p;
    }
    return MC_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* CRC-32C on three streams at once                                                          */
/* ---------------------------------------------------------------------------------------- */

/* One crc32 instruction has a latency of 3 cycles and a throughput of 1 per cycle, so a single
 * dependent chain (crc32c_hw) uses a third of the unit. Three segments of MC_CRC_SEG bytes are
 * run as three independent chains and joined: the raw register update is linear over GF(2),
 * so update(s, A|B) = Z(update(s, A)) ^ update(0, B), where Z appends MC_CRC_SEG zero bytes.
 * Z is a 32x32 bit matrix, applied through four byte tables built once from the slow path.
 * The result is bit-identical to crc32c_hw: the format's checksums do not change. */

#define MC_CRC_SEG 4096

static pthread_once_t crc3_once = PTHREAD_ONCE_INIT;
static uint32_t crc_zeros[4][256]; /* crc_zeros[j][v]: Z applied to v << 8j */

static void init_crc3(void) {
    static const uint8_t zeros[MC_CRC_SEG];
    uint32_t col[32];
    for (int b = 0; b < 32; b++) col[b] = crc32c_soft(1u << b, zeros, MC_CRC_SEG);
    for (int j = 0; j < 4; j++) {
        for (uint32_t v = 0; v < 256; v++) {
            uint32_t r = 0;
            for (int k = 0; k < 8; k++)
                if (v & (1u << k)) r ^= col[8 * j + k];
            crc_zeros[j][v] = r;
        }
    }
}

MC_INLINE uint32_t crc_append_zeros(uint32_t c) {
    return crc_zeros[0][c & 0xFF] ^ crc_zeros[1][(c >> 8) & 0xFF] ^
           crc_zeros[2][(c >> 16) & 0xFF] ^ crc_zeros[3][c >> 24];
}

#if MC_X86
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw3(uint32_t crc, const uint8_t *p,
                                                             size_t n) {
    if (n >= 3 * MC_CRC_SEG) pthread_once(&crc3_once, init_crc3);
    while (n >= 3 * MC_CRC_SEG) {
        uint64_t a = crc, b = 0, c = 0;
        for (size_t i = 0; i < MC_CRC_SEG; i += 8) {
            uint64_t va, vb, vc;
            memcpy(&va, p + i, 8);
            memcpy(&vb, p + MC_CRC_SEG + i, 8);
            memcpy(&vc, p + 2 * MC_CRC_SEG + i, 8);
            a = __builtin_ia32_crc32di(a, va);
            b = __builtin_ia32_crc32di(b, vb);
            c = __builtin_ia32_crc32di(c, vc);
        }
        crc = crc_append_zeros(crc_append_zeros((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
        p += 3 * MC_CRC_SEG;
        n -= 3 * MC_CRC_SEG;
    }
    return crc32c_hw(crc, p, n);
}
#endif

int mc_copy_bytes(uintptr_t dst, uintptr_t src, int64_t n) {
    if (n < 0 || (n > 0 && (dst == 0 || src == 0))) return MC_ERR_ARGUMENT;
    if (n > 0) memmove((void *)dst, (const void *)src, (size_t)n);
    return MC_OK;
}

int mc_slot_range(uintptr_t slots, int64_t n, int64_t *lo, int64_t *hi) {
    if (n < 1 || slots == 0 || lo == NULL || hi == NULL) return MC_ERR_ARGUMENT;
    const int64_t *p = (const int64_t *)slots;
    int64_t a = p[0], b = p[0];
    for (int64_t i = 1; i < n; i++) {
        int64_t v = p[i];
        a = v < a ? v : a;
        b = v > b ? v : b;
    }
    *lo = a;
    *hi = b;
    return MC_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* LZ4 block decoder                                                                         */
/* ---------------------------------------------------------------------------------------- */

/* The LZ4 block format: a sequence is a token (literal count in the high nibble, match length
 * - 4 in the low one; 15 means more length bytes follow, each added, until one is below 255),
 * the literals, then a 2-byte little-endian offset back into the output and the match. The
 * last sequence has literals only. Unlike lz4.block.decompress this writes into the caller's
 * buffer (no fresh bytes object per block) and checks every length against both ends before
 * it copies, so malformed input is an error, never a write outside dst[0:n]. The 16-byte
 * copies below are only taken where 16 bytes of room remain on both sides. */

MC_INLINE int lz4_length(const uint8_t **ip, const uint8_t *iend, size_t *len) {
    unsigned b;
    do {
        if (*ip >= iend) return 0;
        b = *(*ip)++;
        *len += b;
    } while (b == 255);
    return 1;
}

int mc_lz4_decode(const uint8_t *src, int64_t len, uint8_t *dst, int64_t n) {
    if (len < 0 || n < 0 || (len > 0 && src == NULL) || (n > 0 && dst == NULL))
        return MC_ERR_ARGUMENT;
    const uint8_t *ip = src;
    const uint8_t *const iend = src + len;
    uint8_t *op = dst;
    uint8_t *const oend = dst + n;
    for (;;) {
        if (ip >= iend) return MC_ERR_CORRUPT; /* a block ends with a literal-only sequence */
        unsigned token = *ip++;
        size_t lit = token >> 4;
        if (lit == 15 && !lz4_length(&ip, iend, &lit)) return MC_ERR_CORRUPT;
        size_t in_left = (size_t)(iend - ip), out_left = (size_t)(oend - op);
        if (lit > in_left || lit > out_left) return MC_ERR_CORRUPT;
        if (lit <= 16 && in_left >= 16 && out_left >= 16)
            memcpy(op, ip, 16);
        else
            memcpy(op, ip, lit);
        op += lit;
        ip += lit;
        if (ip == iend) break;
        if (iend - ip < 2) return MC_ERR_CORRUPT;
        size_t off = (size_t)ip[0] | ((size_t)ip[1] << 8);
        ip += 2;
        if (off == 0 || off > (size_t)(op - dst)) return MC_ERR_CORRUPT;
        size_t mlen = token & 15;
        if (mlen == 15 && !lz4_length(&ip, iend, &mlen)) return MC_ERR_CORRUPT;
        mlen += 4;
        out_left = (size_t)(oend - op);
        if (mlen > out_left) return MC_ERR_CORRUPT;
        const uint8_t *m = op - off;
        if (off >= 16 && out_left - mlen >= 16) {
            /* Each 16-byte piece reads bytes written at least 16 bytes earlier; the last one
             * may write up to 15 bytes past the match, inside dst, later overwritten. */
            for (size_t i = 0; i < mlen; i += 16) memcpy(op + i, m + i, 16);
        } else if (off >= mlen) {
            memcpy(op, m, mlen);
        } else {
            for (size_t i = 0; i < mlen; i++) op[i] = m[i]; /* overlapping: a repeat */
        }
        op += mlen;
    }
    return op == oend ? MC_OK : MC_ERR_CORRUPT;
}

/* ---------------------------------------------------------------------------------------- */
/* Tagged chunk decode: verify, decode, unshuffle a strip at a time, copy the strip on       */
/* ---------------------------------------------------------------------------------------- */

/* The unshuffle writes the destination a strip at a time from per-plane pointers (a plane's
 * bytes may sit in the payload itself, for a raw block, or in scratch, for a coded one), and
 * each strip is copied on into the caller's tensor while it is still in L1/L2: the chunk's
 * bytes are written twice (slot and tensor) but read back from memory never. */

#define MC_STRIP_BYTES ((size_t)32 << 10)
#define MC_DECODE_STREAM_BYTES ((int64_t)1 << 20)
#define MC_MAX_PLANES 16
#define MC_TAG_RAW 0
#define MC_TAG_LZ4 1
#define MC_TAG_NIBBLE 2

MC_INLINE void interleave2_body(const uint8_t *restrict p0, const uint8_t *restrict p1,
                                uint8_t *restrict d, size_t n) {
    for (size_t i = 0; i < n; i++) {
        d[2 * i] = p0[i];
        d[2 * i + 1] = p1[i];
    }
}

MC_INLINE void interleave4_body(const uint8_t *const *p, uint8_t *restrict d, size_t n) {
    const uint8_t *restrict p0 = p[0], *restrict p1 = p[1], *restrict p2 = p[2],
                            *restrict p3 = p[3];
    for (size_t i = 0; i < n; i++) {
        d[4 * i] = p0[i];
        d[4 * i + 1] = p1[i];
        d[4 * i + 2] = p2[i];
        d[4 * i + 3] = p3[i];
    }
}

static void interleave_base(const uint8_t *const *p, size_t k, uint8_t *d, size_t n) {
    if (k == 1) {
        memcpy(d, p[0], n);
    } else if (k == 2) {
        interleave2_body(p[0], p[1], d, n);
    } else if (k == 4) {
        interleave4_body(p, d, n);
    } else {
        for (size_t i = 0; i < n; i++)
            for (size_t j = 0; j < k; j++) d[i * k + j] = p[j][i];
    }
}

#if MC_X86
__attribute__((target("avx2"))) static void interleave_avx2(const uint8_t *const *p, size_t k,
                                                            uint8_t *d, size_t n) {
    if (k == 2) {
        const uint8_t *p0 = p[0], *p1 = p[1];
        size_t i = 0;
        for (; i + 32 <= n; i += 32) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(p0 + i));
            __m256i b = _mm256_loadu_si256((const __m256i *)(p1 + i));
            __m256i lo = _mm256_unpacklo_epi8(a, b); /* elements 0-7 | 16-23 */
            __m256i hi = _mm256_unpackhi_epi8(a, b); /* elements 8-15 | 24-31 */
            _mm256_storeu_si256((__m256i *)(d + 2 * i), _mm256_permute2x128_si256(lo, hi, 0x20));
            _mm256_storeu_si256((__m256i *)(d + 2 * i + 32),
                                _mm256_permute2x128_si256(lo, hi, 0x31));
        }
        interleave2_body(p0 + i, p1 + i, d + 2 * i, n - i);
    } else if (k == 4) {
        interleave4_body(p, d, n);
    } else {
        interleave_base(p, k, d, n);
    }
}
#endif

static void interleave(const uint8_t *const *p, size_t k, uint8_t *d, size_t n) {
#if MC_X86
    if (MC_LOAD(&simd_level) >= MC_SIMD_AVX2) {
        interleave_avx2(p, k, d, n);
        return;
    }
#endif
    interleave_base(p, k, d, n);
}

#if MC_X86
/* Two planes straight into d with streaming stores, whole 64-byte lines only (the unaligned
 * head and the tail with cached stores). d must be 2-byte aligned. */
__attribute__((target("avx2"))) static void interleave2_stream_avx2(const uint8_t *p0,
                                                                    const uint8_t *p1,
                                                                    uint8_t *d, size_t n) {
    size_t head = ((size_t)(-(uintptr_t)d) & 63u) / 2;
    if (head > n) head = n;
    interleave2_body(p0, p1, d, head);
    size_t i = head;
    for (; i + 32 <= n; i += 32) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(p0 + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(p1 + i));
        __m256i lo = _mm256_unpacklo_epi8(a, b);
        __m256i hi = _mm256_unpackhi_epi8(a, b);
        _mm256_stream_si256((__m256i *)(void *)(d + 2 * i),
                            _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_stream_si256((__m256i *)(void *)(d + 2 * i + 32),
                            _mm256_permute2x128_si256(lo, hi, 0x31));
    }
    interleave2_body(p0 + i, p1 + i, d + 2 * i, n - i);
}
#endif

/* Whether interleave_to writes k planes with streaming stores of its own (itemsizes 1 and 2:
 * a plane copied, or two planes interleaved): the strip loop then writes a single destination
 * straight from the planes, with no strip buffer in between (each output byte is stored once,
 * not stored into the buffer, loaded back and streamed). */
static int interleave_streams(size_t k) {
#if MC_X86
    return k == 1 || (k == 2 && MC_LOAD(&simd_level) >= MC_SIMD_AVX2);
#else
    (void)k;
    return 0;
#endif
}

/* n elements of k planes into d, streaming (put is the streaming copy) where
 * interleave_streams(k) says so and d is aligned to the element, else with cached stores. The
 * caller fences. */
static void interleave_to(const uint8_t *const *p, size_t k, uint8_t *d, size_t n, copy_fn put) {
    if (k == 1) {
        put((char *)d, (const char *)p[0], n);
        return;
    }
#if MC_X86
    if (k == 2 && ((uintptr_t)d & 1u) == 0 && n * 2 >= MC_MIN_STREAM_RUN &&
        MC_LOAD(&simd_level) >= MC_SIMD_AVX2) {
        interleave2_stream_avx2(p[0], p[1], d, n);
        return;
    }
#endif
    interleave(p, k, d, n);
}

int mc_tee_close(mc_tee *tee) {
    if (tee == NULL) return MC_ERR_ARGUMENT;
    __atomic_store_n(&tee->closed, 1, __ATOMIC_SEQ_CST);
    /* A copy in progress saw closed == 0 before we set it: wait for its end (one strip). */
    while (__atomic_load_n(&tee->busy, __ATOMIC_SEQ_CST)) sched_yield();
    return MC_OK;
}

/* Bytes [off, off + n) of the chunk into the runs; 0 (and nothing written) once the tee is
 * closed. busy is raised before closed is read, and mc_tee_close sets closed before it reads
 * busy (both sequentially consistent), so one of the two always sees the other. */
static int runs_enter(const mc_runs *c) {
    mc_tee *tee = c->tee;
    if (tee != NULL) {
        __atomic_store_n(&tee->busy, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&tee->closed, __ATOMIC_SEQ_CST)) {
            __atomic_store_n(&tee->busy, 0, __ATOMIC_RELEASE);
            return 0;
        }
    }
    return 1;
}

static void runs_leave(const mc_runs *c, int64_t n, copy_fn put) {
    /* Streaming stores are weakly ordered: drain them before the tee may be closed. */
    store_fence(put);
    if (c->tee != NULL) {
        __atomic_fetch_add(&c->tee->written, n, __ATOMIC_RELAXED);
        __atomic_store_n(&c->tee->busy, 0, __ATOMIC_RELEASE);
    }
}

static int runs_put(const mc_runs *c, const uint8_t *src, int64_t off, int64_t n, copy_fn put) {
    if (!runs_enter(c)) return 0;
    int64_t r = off / c->run_bytes, o = off % c->run_bytes, left = n;
    while (left > 0) {
        int64_t k = c->run_bytes - o < left ? c->run_bytes - o : left;
        put((char *)(uintptr_t)c->addrs[r] + o, (const char *)src, (size_t)k);
        src += k;
        left -= k;
        r++;
        o = 0;
    }
    runs_leave(c, n, put);
    return 1;
}

/* n elements of k planes (interleave_streams(k)) into the runs from byte off of the chunk,
 * which a run boundary never splits inside an element (run_bytes % k == 0): runs_put without
 * the strip buffer. 0 (and nothing written) once the tee is closed. */
static int runs_interleave(const mc_runs *c, const uint8_t *const *p, size_t k, int64_t off,
                           size_t n, copy_fn put) {
    if (!runs_enter(c)) return 0;
    const uint8_t *q[2] = {p[0], k > 1 ? p[1] : NULL};
    int64_t r = off / c->run_bytes, o = off % c->run_bytes;
    size_t left = n;
    while (left > 0) {
        size_t m = (size_t)(c->run_bytes - o) / k;
        if (m > left) m = left;
        interleave_to(q, k, (uint8_t *)(uintptr_t)c->addrs[r] + o, m, put);
        q[0] += m;
        if (k > 1) q[1] += m;
        left -= m;
        r++;
        o = 0;
    }
    runs_leave(c, (int64_t)(n * k), put);
    return 1;
}

static int check_runs(const mc_runs *c, int64_t total) {
    if (c->num_runs < 0 || c->run_bytes <= 0 || (c->num_runs > 0 && c->addrs == NULL))
        return MC_ERR_ARGUMENT;
    if (c->num_runs > INT64_MAX / c->run_bytes || c->num_runs * c->run_bytes != total)
        return MC_ERR_ARGUMENT;
    return MC_OK;
}

int mc_runs_copy(const mc_runs *copy, const uint8_t *src, int64_t offset, int64_t n) {
    if (copy == NULL || offset < 0 || n < 0 || (n > 0 && src == NULL)) return MC_ERR_ARGUMENT;
    if (copy->num_runs < 0 || copy->run_bytes <= 0 || (copy->num_runs > 0 && copy->addrs == NULL))
        return MC_ERR_ARGUMENT;
    if (copy->num_runs > INT64_MAX / copy->run_bytes ||
        offset > copy->num_runs * copy->run_bytes - n)
        return MC_ERR_ARGUMENT;
    if (n > 0) runs_put(copy, src, offset, n, copy_cached);
    return MC_OK;
}

static uint32_t crc32c_of(const uint8_t *p, size_t n) { return ~crc32c_update(~0u, p, n); }

/* The blocks of one tagged payload, as the strip loop asks for them.
 *
 * From memory (ring == NULL) block i's stored bytes are payload[offs[i]:offs[i+1]] and a
 * coded block decodes into scratch at i * block_size; each is loaded once and kept.
 *
 * From a file (ring != NULL) each block is read into a slot of a small ring (its stored bytes,
 * then its decoded planes), checked and decoded there, and the slot is reused once no piece of
 * the strip loop in progress needs it. A chunk's bytes then pass through a few MiB that stay
 * in cache: through chunk-sized buffers every byte would be a round trip to memory (a read
 * for ownership of each line written, then its write-back), which is most of a decode's
 * memory traffic on a machine whose memory bus is its limit. A block needed again after its
 * slot was reused (one holding the end of a plane and the start of the next) is read, checked
 * and decoded again. */
typedef struct tagged_blocks {
    int fd;
    int64_t file_offset;
    const uint8_t *payload;
    const uint8_t *table;
    const int64_t *offs;
    int64_t block_size, raw_len;
    uint8_t *scratch;
    const uint8_t **base; /* per block: its raw bytes while they are held, else NULL */
    uint8_t *checked;     /* per block: read and verified at least once */
    uint8_t *ring;
    int64_t ring_slots, stored_cap, slot_bytes;
    int64_t *owner;   /* per slot: the block it holds, or -1 */
    int64_t *used;    /* per slot: the last piece (stamp) that used it */
    int64_t *slot_of; /* per block: its slot while it is held */
    int64_t stamp;    /* the piece of the strip loop in progress */
    int *err;
} tagged_blocks;

static int pread_full(int fd, uint8_t *buf, int64_t n, int64_t off, int *err) {
    while (n > 0) {
        ssize_t got = pread(fd, buf, (size_t)n, (off_t)off);
        if (got < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return MC_ERR_IO;
        }
        if (got == 0) return MC_ERR_TRUNCATED; /* the file ends before its header says */
        buf += got;
        n -= got;
        off += got;
    }
    return MC_OK;
}

/* Block i's stored bytes (from the file into st_buf, or in the payload), checked, then
 * decoded into out (a raw body is used where it is). */
static int load_block(tagged_blocks *t, int64_t i, uint8_t *st_buf, uint8_t *out) {
    int64_t stored = t->offs[i + 1] - t->offs[i];
    uint32_t crc = load_le32(t->table + 8 * i + 4);
    int64_t raw_block = t->raw_len - i * t->block_size < t->block_size
                            ? t->raw_len - i * t->block_size : t->block_size;
    const uint8_t *st = t->payload + t->offs[i];
    if (t->ring != NULL) {
        /* Longer than a raw block and its tag: no valid block is, and it would not fit. */
        if (stored > t->stored_cap) return MC_ERR_CORRUPT;
        int status = pread_full(t->fd, st_buf, stored, t->file_offset + t->offs[i], t->err);
        if (status != MC_OK) return status;
        st = st_buf;
    }
    const uint8_t *body = st + 1;
    int64_t body_len = stored - 1;
    if (crc32c_of(st, (size_t)stored) != crc) return MC_ERR_CHECKSUM;
    t->checked[i] = 1;
    if (st[0] == MC_TAG_RAW && body_len == raw_block) {
        t->base[i] = body;
        return MC_OK;
    }
    int status = MC_ERR_CORRUPT;
    if (st[0] == MC_TAG_NIBBLE && body_len < raw_block)
        status = mc_nib_decode(body, body_len, out, raw_block);
    else if (st[0] == MC_TAG_LZ4 && body_len < raw_block)
        status = mc_lz4_decode(body, body_len, out, raw_block);
    if (status != MC_OK) return MC_ERR_CORRUPT;
    t->base[i] = out;
    return MC_OK;
}

/* Block i's raw bytes, loaded first if they are not held. In a ring, the slot taken is an
 * empty one, else the least recently used one that the current piece (t->stamp) does not use:
 * a piece uses at most one block per plane, and the ring has a slot more than planes. */
static int block_at(tagged_blocks *t, int64_t i, const uint8_t **got) {
    if (t->base[i] != NULL) {
        if (t->ring != NULL) t->used[t->slot_of[i]] = t->stamp;
        *got = t->base[i];
        return MC_OK;
    }
    if (t->ring == NULL) {
        int status = load_block(t, i, NULL, t->scratch + i * t->block_size);
        *got = t->base[i];
        return status;
    }
    int64_t s = -1;
    for (int64_t c = 0; c < t->ring_slots; c++) {
        if (t->owner[c] < 0) {
            s = c;
            break;
        }
        if (t->used[c] < t->stamp && (s < 0 || t->used[c] < t->used[s])) s = c;
    }
    if (s < 0) return MC_ERR_ARGUMENT; /* a ring smaller than mc_tagged_ring_bytes says */
    if (t->owner[s] >= 0) t->base[t->owner[s]] = NULL;
    t->owner[s] = -1; /* until block i has loaded: a failure leaves the slot empty */
    uint8_t *st = t->ring + s * t->slot_bytes;
    int status = load_block(t, i, st, st + t->stored_cap);
    if (status != MC_OK) {
        t->base[i] = NULL;
        return status;
    }
    t->owner[s] = i;
    t->used[s] = t->stamp;
    t->slot_of[i] = s;
    *got = t->base[i];
    return MC_OK;
}

/* The byte offsets of the blocks in the payload from the table's stored lengths, which must
 * add up to payload_len. */
static int tagged_offsets(const uint8_t *table, int64_t num_blocks, int64_t payload_len,
                          int64_t *offs, int64_t *bad_block) {
    offs[0] = 0;
    for (int64_t i = 0; i < num_blocks; i++) {
        int64_t stored = (int64_t)load_le32(table + 8 * i);
        if (stored < 1 || stored > payload_len - offs[i]) {
            *bad_block = i;
            return MC_ERR_CORRUPT;
        }
        offs[i + 1] = offs[i] + stored;
    }
    return offs[num_blocks] == payload_len ? MC_OK : MC_ERR_CORRUPT;
}

/* The strip loop (see mc_tagged_decode) over the blocks of t, writing with put. */
static int tagged_strips(tagged_blocks *t, int64_t num_blocks, int64_t itemsize, uint8_t *dst,
                         const mc_runs *copy, copy_fn put, int64_t *bad_block) {
    int status = MC_OK;
    size_t k = (size_t)itemsize, n = (size_t)t->raw_len / k, whole = n * k;
    size_t bs = (size_t)t->block_size;
    size_t strip = MC_STRIP_BYTES / k ? MC_STRIP_BYTES / k : 1;
    int copying = copy != NULL;
    /* One destination, streamed: each piece is unshuffled straight into it (a slot, or the
     * caller's runs), not into the strip buffer first. */
    int direct = put != copy_cached && interleave_streams(k) &&
                 (copy == NULL ? dst != NULL : dst == NULL && copy->run_bytes % (int64_t)k == 0);
    static _Thread_local uint8_t strip_buf[MC_STRIP_BYTES] __attribute__((aligned(64)));
    const uint8_t *planes[MC_MAX_PLANES];
    const uint8_t *b;
    for (size_t e0 = 0; e0 < n;) {
        size_t e1 = n - e0 < strip ? n : e0 + strip;
        /* Without dst (a read straight into the caller's runs) every strip goes through the
         * buffer, unless it is direct. */
        uint8_t *to = put == copy_cached && dst != NULL ? dst + e0 * k : strip_buf;
        for (size_t e = e0; e < e1;) {
            size_t cnt = e1 - e;
            t->stamp++; /* a piece: elements [e, e + cnt), one block per plane */
            for (size_t j = 0; j < k; j++) {
                size_t p = j * n + e, off = p % bs;
                if (bs - off < cnt) cnt = bs - off;
                if ((status = block_at(t, (int64_t)(p / bs), &b)) != MC_OK) {
                    *bad_block = (int64_t)(p / bs);
                    return status;
                }
                planes[j] = b + off;
            }
            if (!direct) {
                interleave(planes, k, to + (e - e0) * k, cnt);
            } else if (dst != NULL) {
                interleave_to(planes, k, dst + e * k, cnt, put);
            } else if (!runs_interleave(copy, planes, k, (int64_t)(e * k), cnt, put)) {
                return MC_OK; /* the tee was closed: nothing left to write */
            }
            e += cnt;
        }
        if (direct) {
            e0 = e1;
            continue;
        }
        if (put != copy_cached && dst != NULL)
            put((char *)(dst + e0 * k), (const char *)strip_buf, (e1 - e0) * k);
        if (copying)
            copying = runs_put(copy, to, (int64_t)(e0 * k), (int64_t)((e1 - e0) * k), put);
        if (!copying && dst == NULL) return MC_OK; /* the tee was closed: nothing left to write */
        e0 = e1;
    }
    /* The bytes past the last whole element (fewer than itemsize): into dst, or without it
     * into a small buffer for the runs. */
    uint8_t tail[MC_MAX_PLANES];
    uint8_t *tail_to = dst != NULL ? dst + whole : tail;
    for (size_t p = whole; p < (size_t)t->raw_len; p++) {
        t->stamp++;
        if ((status = block_at(t, (int64_t)(p / bs), &b)) != MC_OK) {
            *bad_block = (int64_t)(p / bs);
            return status;
        }
        tail_to[p - whole] = b[p % bs];
    }
    if (copying && whole < (size_t)t->raw_len)
        runs_put(copy, tail_to, (int64_t)whole, t->raw_len - (int64_t)whole, copy_cached);
    /* A block no strip needed (none, for a consistent table) is still read and checked. */
    for (int64_t i = 0; i < num_blocks; i++) {
        t->stamp++;
        if (!t->checked[i] && (status = block_at(t, i, &b)) != MC_OK) {
            *bad_block = i;
            return status;
        }
    }
    return MC_OK;
}

static int tagged_run(tagged_blocks *t, int64_t num_blocks, int64_t itemsize, uint8_t *dst,
                      const mc_runs *copy, int64_t *bad_block) {
    /* A chunk of MC_DECODE_STREAM_BYTES or more takes streaming stores (no read for ownership
     * of lines that are only written; nothing reads them back soon: they are a tier's slot and
     * the caller's tensor): the strip is unshuffled into a buffer that stays in L1 and
     * streamed from there to dst and to the runs. A smaller one is unshuffled into dst. */
    copy_fn put = t->raw_len >= MC_DECODE_STREAM_BYTES ? pick_copy(INT64_MAX) : copy_cached;
    int status = tagged_strips(t, num_blocks, itemsize, dst, copy, put, bad_block);
    store_fence(put);
    return status;
}

/* The per-block and per-slot arrays of t, in one allocation (free t->base). */
static int tagged_arrays(tagged_blocks *t, int64_t num_blocks, int64_t **offs) {
    size_t nb = (size_t)num_blocks, ns = (size_t)t->ring_slots;
    size_t words = nb + (nb + 1) + nb + 2 * ns; /* base, offs, slot_of, owner, used */
    void *mem = calloc(words * sizeof(int64_t) + nb, 1);
    if (mem == NULL) return MC_ERR_NO_MEMORY;
    t->base = (const uint8_t **)mem;
    int64_t *w = (int64_t *)mem + nb;
    *offs = w;
    t->offs = w;
    t->slot_of = w + nb + 1;
    t->owner = t->slot_of + nb;
    t->used = t->owner + ns;
    t->checked = (uint8_t *)(t->used + ns);
    for (size_t s = 0; s < ns; s++) t->owner[s] = -1;
    return MC_OK;
}

static int tagged_args_ok(int64_t payload_len, int64_t num_blocks, int64_t block_size,
                          int64_t raw_len, int64_t itemsize) {
    if (payload_len < 0 || num_blocks < 0 || block_size <= 0 || raw_len < 0 || itemsize < 1 ||
        itemsize > MC_MAX_PLANES)
        return 0;
    return num_blocks == raw_len / block_size + (raw_len % block_size != 0);
}

int mc_tagged_decode(const uint8_t *payload, int64_t payload_len, const uint8_t *table,
                     int64_t num_blocks, int64_t block_size, int64_t raw_len, int64_t itemsize,
                     uint8_t *scratch, int64_t scratch_len, uint8_t *dst, const mc_runs *copy,
                     int64_t *bad_block) {
    if (bad_block == NULL) return MC_ERR_ARGUMENT;
    *bad_block = -1;
    if (!tagged_args_ok(payload_len, num_blocks, block_size, raw_len, itemsize) ||
        scratch_len < raw_len)
        return MC_ERR_ARGUMENT;
    if (raw_len > 0 && (table == NULL || scratch == NULL || payload == NULL ||
                        (dst == NULL && copy == NULL)))
        return MC_ERR_ARGUMENT;
    if (copy != NULL && check_runs(copy, raw_len) != MC_OK) return MC_ERR_ARGUMENT;
    if (raw_len == 0) return payload_len == 0 ? MC_OK : MC_ERR_CORRUPT;
    ensure_settings();
    int err = 0;
    tagged_blocks t = {.fd = -1, .payload = payload, .table = table, .block_size = block_size,
                       .raw_len = raw_len, .scratch = scratch, .err = &err};
    int64_t *offs;
    if (tagged_arrays(&t, num_blocks, &offs) != MC_OK) return MC_ERR_NO_MEMORY;
    int status = tagged_offsets(table, num_blocks, payload_len, offs, bad_block);
    /* Every block is checked before dst is written (decode_chunk leaves its out untouched on
     * any error). */
    const uint8_t *b;
    for (int64_t i = 0; status == MC_OK && i < num_blocks; i++) {
        status = block_at(&t, i, &b);
        if (status != MC_OK) *bad_block = i;
    }
    if (status == MC_OK) status = tagged_run(&t, num_blocks, itemsize, dst, copy, bad_block);
    free(t.base);
    return status;
}

/* The ring of mc_tagged_read: a slot more than the planes (no more than the blocks), each
 * slot a block's stored bytes (its tag included) then its decoded planes, 64-byte aligned. */
static int64_t ring_slots_for(int64_t num_blocks, int64_t itemsize) {
    return num_blocks < itemsize + 1 ? num_blocks : itemsize + 1;
}

static int64_t round64(int64_t n) { return (n + 63) / 64 * 64; }

/* A slot's stored area: the largest valid block (a raw one and its tag). */
static int64_t ring_stored_cap(int64_t block_size) { return round64(block_size + 1); }

static int64_t ring_slot_bytes(int64_t block_size) {
    return ring_stored_cap(block_size) + round64(block_size);
}

int64_t mc_tagged_ring_bytes(int64_t num_blocks, int64_t block_size, int64_t itemsize) {
    if (num_blocks < 0 || block_size <= 0 || block_size > (INT64_MAX >> 8) || itemsize < 1 ||
        itemsize > MC_MAX_PLANES)
        return -1;
    return ring_slots_for(num_blocks, itemsize) * ring_slot_bytes(block_size);
}

int mc_tagged_read(int fd, int64_t file_offset, int64_t payload_len, const uint8_t *table,
                   int64_t num_blocks, int64_t block_size, int64_t raw_len, int64_t itemsize,
                   uint8_t *ring, int64_t ring_len, uint8_t *dst, const mc_runs *copy,
                   int64_t *bad_block, int *err) {
    if (bad_block == NULL || err == NULL) return MC_ERR_ARGUMENT;
    *bad_block = -1;
    *err = 0;
    if (fd < 0 || file_offset < 0 ||
        !tagged_args_ok(payload_len, num_blocks, block_size, raw_len, itemsize))
        return MC_ERR_ARGUMENT;
    int64_t need = mc_tagged_ring_bytes(num_blocks, block_size, itemsize);
    if (need < 0 || ring_len < need) return MC_ERR_ARGUMENT;
    if (raw_len > 0 && (table == NULL || ring == NULL || (dst == NULL && copy == NULL)))
        return MC_ERR_ARGUMENT;
    if (copy != NULL && check_runs(copy, raw_len) != MC_OK) return MC_ERR_ARGUMENT;
    if (raw_len == 0) return payload_len == 0 ? MC_OK : MC_ERR_CORRUPT;
    ensure_settings();
    tagged_blocks t = {.fd = fd, .file_offset = file_offset, .table = table,
                       .block_size = block_size, .raw_len = raw_len, .ring = ring,
                       .ring_slots = ring_slots_for(num_blocks, itemsize),
                       .stored_cap = ring_stored_cap(block_size),
                       .slot_bytes = ring_slot_bytes(block_size), .err = err};
    int64_t *offs;
    if (tagged_arrays(&t, num_blocks, &offs) != MC_OK) return MC_ERR_NO_MEMORY;
    int status = tagged_offsets(table, num_blocks, payload_len, offs, bad_block);
    /* Each block is read, checked and decoded right before its first use, so it is still in
     * cache when it is unshuffled: a failure leaves the strips before it written, every one
     * of them from verified blocks. */
    if (status == MC_OK) status = tagged_run(&t, num_blocks, itemsize, dst, copy, bad_block);
    free(t.base);
    return status;
}

/* The arguments every read of a raw object's payload checks first. */
static int raw_layout_ok(int fd, int64_t file_offset, int64_t num_blocks, int64_t block_size,
                         int64_t raw_len) {
    if (fd < 0 || file_offset < 0 || num_blocks < 0 || block_size <= 0 || raw_len < 0) return 0;
    return num_blocks == raw_len / block_size + (raw_len % block_size != 0);
}

/* One block of a raw object (its table entry at entry: stored length, CRC-32C) read from the
 * file at offset into buf and checked there. */
static int raw_block_read(int fd, int64_t offset, const uint8_t *entry, int64_t len,
                          uint8_t *buf, int *err) {
    if ((int64_t)load_le32(entry) != len) return MC_ERR_CORRUPT;
    int status = pread_full(fd, buf, len, offset, err);
    if (status == MC_OK && crc32c_of(buf, (size_t)len) != load_le32(entry + 4))
        status = MC_ERR_CHECKSUM;
    return status;
}

int mc_raw_read(int fd, int64_t file_offset, const uint8_t *table, int64_t num_blocks,
                int64_t block_size, int64_t raw_len, uint8_t *dst, const mc_runs *copy,
                int64_t *bad_block, int *err) {
    if (bad_block == NULL || err == NULL) return MC_ERR_ARGUMENT;
    *bad_block = -1;
    *err = 0;
    if (!raw_layout_ok(fd, file_offset, num_blocks, block_size, raw_len)) return MC_ERR_ARGUMENT;
    if (raw_len > 0 && (dst == NULL || table == NULL)) return MC_ERR_ARGUMENT;
    if (copy != NULL && check_runs(copy, raw_len) != MC_OK) return MC_ERR_ARGUMENT;
    /* The slot is written by the kernel's copy, so it is in cache for the checksum and the
     * copy on; only the copy into the runs can stream. */
    copy_fn put = raw_len >= MC_DECODE_STREAM_BYTES ? pick_copy(INT64_MAX) : copy_cached;
    int copying = copy != NULL;
    int status = MC_OK;
    for (int64_t i = 0; i < num_blocks; i++) {
        int64_t start = i * block_size;
        int64_t len = raw_len - start < block_size ? raw_len - start : block_size;
        status = raw_block_read(fd, file_offset + start, table + 8 * i, len, dst + start, err);
        if (status != MC_OK) {
            *bad_block = i;
            break;
        }
        if (copying) copying = runs_put(copy, dst + start, start, len, put);
    }
    store_fence(put);
    return status;
}

int mc_raw_read_runs(int fd, int64_t file_offset, const uint8_t *table, int64_t num_blocks,
                     int64_t block_size, int64_t raw_len, uint8_t *scratch, int64_t scratch_len,
                     const mc_runs *copy, int64_t *bad_block, int *err) {
    if (bad_block == NULL || err == NULL) return MC_ERR_ARGUMENT;
    *bad_block = -1;
    *err = 0;
    if (!raw_layout_ok(fd, file_offset, num_blocks, block_size, raw_len)) return MC_ERR_ARGUMENT;
    if (raw_len > 0 && (scratch == NULL || table == NULL || copy == NULL ||
                        scratch_len < (block_size < raw_len ? block_size : raw_len)))
        return MC_ERR_ARGUMENT;
    if (copy != NULL && check_runs(copy, raw_len) != MC_OK) return MC_ERR_ARGUMENT;
    /* Each block lands in the same scratch block, which stays in cache for its checksum and
     * its copy on; only the copy into the runs, which nothing reads back soon, can stream. */
    copy_fn put = raw_len >= MC_DECODE_STREAM_BYTES ? pick_copy(INT64_MAX) : copy_cached;
    int status = MC_OK;
    for (int64_t i = 0; i < num_blocks; i++) {
        int64_t start = i * block_size;
        int64_t len = raw_len - start < block_size ? raw_len - start : block_size;
        status = raw_block_read(fd, file_offset + start, table + 8 * i, len, scratch, err);
        if (status != MC_OK) {
            *bad_block = i;
            break;
        }
        if (!runs_put(copy, scratch, start, len, put)) break; /* closed: nothing left to do */
    }
    store_fence(put);
    return status;
}

/* ---------------------------------------------------------------------------------------- */
/* CRC-32C by carry-less multiplication (AVX-512 VPCLMULQDQ)                                 */
/* ---------------------------------------------------------------------------------------- */

/* The crc32 instruction takes 8 bytes a cycle at best (three chains, above: about 18 GiB/s
 * here, a fifth of the L2 cache's bandwidth, and a quarter of a disk read's CPU time). A
 * 512-bit carry-less multiply folds 64 bytes at a time instead:
 *
 * In the reflected bit order of this CRC, a 16-byte lane loaded little-endian holds a
 * polynomial A = H * x^64 + L (H: its first 8 bytes, the higher degrees). The message's
 * remainder mod P does not change when A, S bits ahead of a later lane B, is replaced by
 * H * (x^(S+64) mod P) + L * (x^S mod P): a polynomial of under 96 bits, XORed into B. A
 * reflected 64x64 carry-less multiply returns the product times x, so the constants are
 * x^(S+63) and x^(S-1) mod P. What is left at the end is one lane F congruent to the
 * message (the incoming register XORed into its first 4 bytes), and two crc32 instructions
 * from a zero register turn F into the register, F * x^32 mod P. Bit-identical to crc32c_hw.
 */

#if MC_X86

/* x^n mod P, P the Castagnoli polynomial in normal bit order (bit d: x^d). */
static uint32_t crc_xpow(unsigned n) {
    uint64_t r = 1;
    while (n--) {
        r <<= 1;
        if (r >> 32) r ^= 0x11EDC6F41ull;
    }
    return (uint32_t)r;
}

/* The reflected multiply operand for x^(n-1) mod P: bit d of the remainder at bit 63 - d. */
static uint64_t crc_fold_operand(unsigned n) {
    uint32_t r = crc_xpow(n - 1);
    uint64_t k = 0;
    for (int d = 0; d < 32; d++)
        if (r >> d & 1) k |= 1ull << (63 - d);
    return k;
}

/* Per fold distance S in bits: {operand for the lane's first 8 bytes, for its last 8}. */
enum { FOLD_2048, FOLD_512, FOLD_384, FOLD_256, FOLD_128, FOLD_COUNT };
static uint64_t fold_k[FOLD_COUNT][2];

static void init_fold_constants(void) {
    static const unsigned dist[FOLD_COUNT] = {2048, 512, 384, 256, 128};
    for (int i = 0; i < FOLD_COUNT; i++) {
        fold_k[i][0] = crc_fold_operand(dist[i] + 64);
        fold_k[i][1] = crc_fold_operand(dist[i]);
    }
}

#define MC_FOLD_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))

MC_FOLD_TARGET static inline __m512i fold512(__m512i a, __m512i k, __m512i into) {
    /* 0x96: a ^ b ^ c */
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00),
                                     _mm512_clmulepi64_epi128(a, k, 0x11), into, 0x96);
}

MC_FOLD_TARGET static inline __m128i fold128(__m128i a, __m128i k, __m128i into) {
    return _mm_ternarylogic_epi64(_mm_clmulepi64_si128(a, k, 0x00),
                                  _mm_clmulepi64_si128(a, k, 0x11), into, 0x96);
}

MC_FOLD_TARGET static __m128i fold_k128(int which) {
    return _mm_set_epi64x((long long)fold_k[which][1], (long long)fold_k[which][0]);
}

/* n >= MC_CRC_FOLD_MIN (256). Four 64-byte accumulators, each folded 256 bytes on per step:
 * four independent chains keep the multiplier busy through its latency. */
MC_FOLD_TARGET static uint32_t crc32c_fold512(uint32_t crc, const uint8_t *p, size_t n) {
    __m512i x0 = _mm512_loadu_si512((const void *)p);
    __m512i x1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(p + 128));
    __m512i x3 = _mm512_loadu_si512((const void *)(p + 192));
    x0 = _mm512_xor_si512(
        x0, _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128((int)crc), 0));
    p += 256;
    n -= 256;
    __m512i k = _mm512_broadcast_i32x4(fold_k128(FOLD_2048));
    while (n >= 256) {
        x0 = fold512(x0, k, _mm512_loadu_si512((const void *)p));
        x1 = fold512(x1, k, _mm512_loadu_si512((const void *)(p + 64)));
        x2 = fold512(x2, k, _mm512_loadu_si512((const void *)(p + 128)));
        x3 = fold512(x3, k, _mm512_loadu_si512((const void *)(p + 192)));
        p += 256;
        n -= 256;
    }
    k = _mm512_broadcast_i32x4(fold_k128(FOLD_512));
    x1 = fold512(x0, k, x1);
    x2 = fold512(x1, k, x2);
    x3 = fold512(x2, k, x3);
    while (n >= 64) {
        x3 = fold512(x3, k, _mm512_loadu_si512((const void *)p));
        p += 64;
        n -= 64;
    }
    /* The four lanes of x3 into its last one: 384, 256 and 128 bits ahead of it. */
    __m128i r = _mm512_extracti32x4_epi32(x3, 3);
    r = fold128(_mm512_extracti32x4_epi32(x3, 0), fold_k128(FOLD_384), r);
    r = fold128(_mm512_extracti32x4_epi32(x3, 1), fold_k128(FOLD_256), r);
    r = fold128(_mm512_extracti32x4_epi32(x3, 2), fold_k128(FOLD_128), r);
    __m128i k128 = fold_k128(FOLD_128);
    while (n >= 16) {
        r = fold128(r, k128, _mm_loadu_si128((const __m128i *)p));
        p += 16;
        n -= 16;
    }
    uint64_t c = __builtin_ia32_crc32di(0, (uint64_t)_mm_cvtsi128_si64(r));
    c = __builtin_ia32_crc32di(c, (uint64_t)_mm_extract_epi64(r, 1));
    return crc32c_hw((uint32_t)c, p, n);
}
#endif
