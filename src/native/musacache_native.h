/* musacache native transfer module: paged KV <-> dense rows, and the byte-shuffle filter.
 *
 * Plain C (no Python.h). Every function but mc_version() returns an mc_status; 0 is success.
 * build.py hands everything outside the preprocessor lines of this file to cffi's cdef, so
 * declarations below use only types cffi knows (stdint types, enums, structs, pointers).
 */
#ifndef MUSACACHE_NATIVE_H
#define MUSACACHE_NATIVE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mc_status {
    MC_OK = 0,
    MC_ERR_ARGUMENT = 1,   /* a null pointer, a negative size or stride, a zero block size */
    MC_ERR_SLOT_RANGE = 2, /* a slot < -1 or >= num_slots; nothing was written */
    MC_ERR_NO_MEMORY = 3,  /* the run table could not be allocated; nothing was written */
    MC_ERR_NO_GAIN = 4,    /* mc_nib_encode: the coded block would not be smaller; dst unused */
    MC_ERR_CORRUPT = 5,    /* a coded block is inconsistent (nibble, lz4, tagged); dst is garbage */
    MC_ERR_CHECKSUM = 6,   /* a tagged or raw block's CRC-32C does not match its table entry */
    MC_ERR_IO = 7,         /* a read from a file failed; *err is its errno */
    MC_ERR_TRUNCATED = 8   /* a read from a file: the file ends before the payload does */
} mc_status;

/* SIMD levels for mc_set_simd_level(); a level above what the CPU has is clamped down. */
typedef enum mc_simd_level {
    MC_SIMD_NONE = 0,   /* plain memcpy and scalar loops */
    MC_SIMD_SSE2 = 1,
    MC_SIMD_AVX2 = 2,
    MC_SIMD_AVX512 = 3
} mc_simd_level;

/* One row copy between paged planes and dense planes.
 *
 * A plane is one (layer, K-or-V[, head]) slice. Row `slot` of paged plane p starts at
 *   paged_planes[p] + (slot / block_size) * block_stride + (slot % block_size) * slot_stride
 * and row t of dense plane p starts at
 *   dense_planes[p] + t * dense_row_stride.
 * Each row is row_bytes contiguous bytes. Token t uses slots[t]; a slot of -1 is skipped.
 * All strides are in bytes. The caller guarantees every addressed row lies inside its buffer.
 *
 * Chunks: with num_chunks > 1 the tokens are split into consecutive chunks, each with its own
 * dense buffers (one request copied into many chunk tensors in one call). Chunk k covers tokens
 * [chunk_starts[k], chunk_starts[k + 1]) (chunk_starts has num_chunks + 1 entries, from 0 to
 * num_tokens, non-decreasing); its dense planes are dense_planes[k * num_planes + p], and its
 * token t sits at row t - chunk_starts[k]. num_chunks 0 or 1 with chunk_starts NULL is one
 * chunk of all the tokens.
 */
typedef struct mc_row_copy {
    char *const *paged_planes;
    char *const *dense_planes;
    int64_t num_planes;
    int64_t row_bytes;
    int64_t block_size;
    int64_t block_stride;
    int64_t slot_stride;
    int64_t num_slots;
    int64_t dense_row_stride;
    const int64_t *slots;
    int64_t num_tokens;
    int64_t num_chunks;
    const int64_t *chunk_starts;
} mc_row_copy;

const char *mc_version(void);

/* paged -> dense. Work is split over up to num_threads threads by plane and token range. */
int mc_gather_rows(const mc_row_copy *copy, int num_threads);

/* dense -> paged. Work is split by plane only, so when a slot repeats the last token wins. */
int mc_scatter_rows(const mc_row_copy *copy, int num_threads);

/* Byte-shuffle: dst[j * n + i] = src[i * itemsize + j] for n = nbytes / itemsize whole
 * elements; the nbytes % itemsize trailing bytes are copied as they are. src and dst must not
 * overlap. */
int mc_shuffle(const uint8_t *src, uint8_t *dst, int64_t nbytes, int64_t itemsize);
int mc_unshuffle(const uint8_t *src, uint8_t *dst, int64_t nbytes, int64_t itemsize);

/* CRC-32C (Castagnoli), chained like zlib.crc32: crc32c(b, crc32c(a, 0)) == crc32c(a + b, 0).
 * Uses the SSE4.2 crc32 instruction when the SIMD level is SSE2 or above and the CPU has it,
 * else a slicing-by-8 table. */
int mc_crc32c(const uint8_t *src, int64_t nbytes, uint32_t seed, uint32_t *out);

/* Nibble table coder for one plane of bytes (the exponent plane of bf16/fp16 KV).
 * Layout of a coded block of n bytes (all integers little-endian):
 *   book[15]          the 15 most frequent bytes (unused entries 0); code k < 15 = book[k]
 *   pad u8 = 0
 *   ne u32            number of escapes (bytes not in the book, code 15)
 *   codes[(n+1)/2]    byte i is the low nibble of codes[i/2] when i is even, else the high one;
 *                     for odd n the last high nibble is 0
 *   ne x (pos u32, val u8)  the escaped bytes and their positions, positions increasing
 * MC_NIB_OVERHEAD is the fixed part (20 bytes). */
#define MC_NIB_OVERHEAD 20
/* Encodes src[0:n] into dst (cap >= n bytes; src and dst must not overlap). The book comes
 * from a sample histogram. MC_ERR_NO_GAIN when the coded size would be >= n (dst then holds
 * garbage); MC_ERR_ARGUMENT for cap < n or n > 2^31 - 1. *out_len is the coded size (< n). */
int mc_nib_encode(const uint8_t *src, int64_t n, uint8_t *dst, int64_t cap, int64_t *out_len);
/* Decodes a coded block of len bytes into dst[0:n]. MC_ERR_CORRUPT when the block is not the
 * exact, self-consistent coding of n bytes (length, escape count, positions, padding). */
int mc_nib_decode(const uint8_t *src, int64_t len, uint8_t *dst, int64_t n);

/* *out = 1 when non-temporal stores are compiled in and the CPU has them, else 0. */
int mc_has_streaming_stores(int *out);

/* Copies whose total exceeds this many bytes use streaming stores. -1 restores the default
 * (derived from the last-level cache size). */
int mc_set_streaming_threshold(int64_t nbytes);
int mc_get_streaming_threshold(int64_t *out);

/* A call uses at most one thread per this many bytes it copies. -1 restores the default
 * (2 MiB); 0 lets every call use all the threads it is given (tests use it). */
int mc_set_thread_min_bytes(int64_t nbytes);
int mc_get_thread_min_bytes(int64_t *out);

/* The SIMD level in use; setting clamps to what the CPU supports (tests use it to reach
 * every code path on one machine). */
int mc_set_simd_level(int level);
int mc_get_simd_level(int *out);
int mc_max_simd_level(int *out);

/* memmove(dst, src, n) between two addresses given as integers: the direct read path copies a
 * small chunk between host buffers whose bounds the caller has checked, in one call and
 * without building a pointer object per call. MC_ERR_ARGUMENT for n < 0 or a null address. */
int mc_copy_bytes(uintptr_t dst, uintptr_t src, int64_t n);

/* The least and greatest of the n int64 values at address slots (a store's slot_mapping,
 * range-checked before any page is read): one pass, where numpy's min and max reductions cost
 * about 0.1 ms on a store's critical path with the CPU's caches cold from the copy before.
 * MC_ERR_ARGUMENT for n < 1 or a null address. */
int mc_slot_range(uintptr_t slots, int64_t n, int64_t *lo, int64_t *hi);

/* -- chunk decode into its destinations (codec.py, "lz4" codec id 2) ------------------------ */

/* LZ4 block format (no frame): decodes src[0:len] into exactly dst[0:n]. MC_ERR_CORRUPT when
 * the block is malformed or does not decode to exactly n bytes: every read is checked against
 * src + len and every write against dst + n, so nothing outside dst[0:n] is ever written. */
int mc_lz4_decode(const uint8_t *src, int64_t len, uint8_t *dst, int64_t n);

/* A second destination written while a decode runs (the caller's tensor for one chunk), and the
 * handshake that lets another thread stop it. closed and busy are only touched atomically:
 * mc_tee_close() sets closed and waits while a run copy is in progress, so once it returns no
 * byte is written into the runs any more. written counts the bytes copied into the runs. */
typedef struct mc_tee {
    int32_t closed;
    int32_t busy;
    int64_t written;
} mc_tee;

/* num_runs runs of run_bytes each: run r (at address addrs[r]) takes bytes
 * [r * run_bytes, (r + 1) * run_bytes) of the decoded chunk. */
typedef struct mc_runs {
    const uint64_t *addrs;
    int64_t num_runs;
    int64_t run_bytes;
    mc_tee *tee;
} mc_runs;

int mc_tee_close(mc_tee *tee);

/* One chunk object's payload of tagged blocks (method byte, then body; each block's CRC-32C
 * covers both) into dst[0:raw_len], unshuffled for itemsize > 1. table holds num_blocks
 * little-endian (stored_len u32, crc u32) pairs, as the object stores them; the stored
 * lengths must add up to payload_len. Coded blocks are decoded into scratch (at least raw_len
 * bytes; a raw body is used in place). Every block is checked and decoded before the first
 * byte of dst or of the runs is written. dst is written a strip at a time, and each strip is
 * copied on into copy's runs (when copy is not NULL and its tee is not closed) while it is in
 * cache. dst may be NULL when copy is not: the runs are then the only destination, and the
 * decode stops (MC_OK) once the tee is closed.
 * On MC_ERR_CHECKSUM or MC_ERR_CORRUPT, *bad_block is the failing block (-1: the table's
 * lengths). */
int mc_tagged_decode(const uint8_t *payload, int64_t payload_len, const uint8_t *table,
                     int64_t num_blocks, int64_t block_size, int64_t raw_len, int64_t itemsize,
                     uint8_t *scratch, int64_t scratch_len, uint8_t *dst, const mc_runs *copy,
                     int64_t *bad_block);

/* The bytes of the ring mc_tagged_read needs (-1 for arguments no payload has): a few blocks'
 * worth, however large the chunk. */
int64_t mc_tagged_ring_bytes(int64_t num_blocks, int64_t block_size, int64_t itemsize);

/* mc_tagged_decode of the payload (payload_len bytes) at file_offset of the file fd: each
 * block is read into a slot of ring (at least mc_tagged_ring_bytes), checked and decoded there
 * just before the first strip that needs it, so a chunk's bytes pass through a few blocks of
 * cache instead of chunk-sized buffers. A failure leaves the strips before it written (in dst
 * and the runs), every one of them from verified blocks. Errors as mc_tagged_decode's, and:
 * MC_ERR_TRUNCATED: the file ended inside block *bad_block; MC_ERR_IO: *err is the errno of
 * the failed read. */
int mc_tagged_read(int fd, int64_t file_offset, int64_t payload_len, const uint8_t *table,
                   int64_t num_blocks, int64_t block_size, int64_t raw_len, int64_t itemsize,
                   uint8_t *ring, int64_t ring_len, uint8_t *dst, const mc_runs *copy,
                   int64_t *bad_block, int *err);

/* A raw chunk object's payload (codec id 3: every block stored as it is, table as stored) from
 * the file at file_offset straight into dst[0:raw_len], a block at a time: each block's
 * CRC-32C is checked right after its read, and the verified block is then copied on into
 * copy's runs. Errors as mc_tagged_read's (MC_ERR_CORRUPT: a block's stored length is not
 * its raw length); dst then holds part of the chunk, the runs only verified blocks. */
int mc_raw_read(int fd, int64_t file_offset, const uint8_t *table, int64_t num_blocks,
                int64_t block_size, int64_t raw_len, uint8_t *dst, const mc_runs *copy,
                int64_t *bad_block, int *err);

/* mc_raw_read without a slot: each block is read into scratch (at least one block, or the
 * whole chunk if it is smaller), checked there and copied on into copy's runs, the only
 * destination. Stops, returning MC_OK, once the tee is closed (the caller tells a complete
 * read by the tee's written count). Errors as mc_raw_read's; the runs then hold only
 * verified blocks. */
int mc_raw_read_runs(int fd, int64_t file_offset, const uint8_t *table, int64_t num_blocks,
                     int64_t block_size, int64_t raw_len, uint8_t *scratch, int64_t scratch_len,
                     const mc_runs *copy, int64_t *bad_block, int *err);

/* Verified bytes [offset, offset + n) of a chunk, src, copied into copy's runs (the raw
 * codec's blocks, read straight into the slot); stops, as mc_tagged_decode does, once the tee
 * is closed. MC_ERR_ARGUMENT when the range lies outside the runs. */
int mc_runs_copy(const mc_runs *copy, const uint8_t *src, int64_t offset, int64_t n);

#ifdef __cplusplus
}
#endif

#endif /* MUSACACHE_NATIVE_H */
