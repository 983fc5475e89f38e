/* musacache native transfer module. See musacache_native.h for the contract.
 *
 * Design notes (the measurements behind them are in docs/bench_transfer.md):
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

#include <pthread.h>
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
    int64_t dense_off;
    int64_t nbytes;
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
    for (int64_t p = 0; p < c->num_planes; p++) {
        if (c->paged_planes[p] == NULL || c->dense_planes[p] == NULL) return MC_ERR_ARGUMENT;
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
    for (int64_t t = 0; t < c->num_tokens; t++) {
        int64_t s = slots[t];
        if (s < 0) continue;
        int64_t paged = (s / c->block_size) * c->block_stride + (s % c->block_size) * c->slot_stride;
        int64_t dense = t * c->dense_row_stride;
        if (n > 0) {
            run *last = &runs[n - 1];
            if (last->paged_off + last->nbytes == paged && last->dense_off + last->nbytes == dense) {
                last->nbytes += c->row_bytes;
                continue;
            }
        }
        runs[n].paged_off = paged;
        runs[n].dense_off = dense;
        runs[n].nbytes = c->row_bytes;
        n++;
    }
    *num_runs = n;
    return MC_OK;
}

/* The source of each run starts at a random place, where the hardware prefetcher has no
 * stream yet; asking for the head of the next run while the current one copies hides part
 * of that miss (about 8% on a 2 GiB cache with 32 KiB runs). */
#define MC_PREFETCH_BYTES 1024

static void prefetch_run_head(const work *w, const char *paged, const char *dense,
                              const run *next) {
#if defined(__GNUC__) || defined(__clang__)
    const char *src = w->to_dense ? paged + next->paged_off : dense + next->dense_off;
    int64_t n = next->nbytes < MC_PREFETCH_BYTES ? next->nbytes : MC_PREFETCH_BYTES;
    for (int64_t off = 0; off < n; off += 64) __builtin_prefetch(src + off, 0, 3);
#else
    (void)w, (void)paged, (void)dense, (void)next;
#endif
}

static void do_work(const work *w) {
    const mc_row_copy *c = w->copy;
    for (int64_t u = w->unit_begin; u < w->unit_end; u++) {
        int64_t plane = u / w->num_segs;
        int64_t seg = u % w->num_segs;
        char *paged = c->paged_planes[plane];
        char *dense = c->dense_planes[plane];
        int64_t last = w->seg_bounds[seg + 1];
        for (int64_t r = w->seg_bounds[seg]; r < last; r++) {
            const run *rn = &w->runs[r];
            if (r + 1 < last) prefetch_run_head(w, paged, dense, &w->runs[r + 1]);
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
