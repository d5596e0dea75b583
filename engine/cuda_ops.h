// Elementwise and row kernels of the CUDA backend (cuda_ops.cu), behind plain C++ launchers:
// no CUDA types here except the forward-declared stream. Every launcher takes the model dtype
// as a flag (fp16 or bf16; "T" below) and enqueues on `stream`; none allocates.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace treeserve::cuda {

enum class Dtype : int32_t { kFloat16 = 0, kBFloat16 = 1 };

// residual [rows][hidden] float = table[ids[r]] (T [vocab][hidden]).
void embed(Dtype dt, const int32_t* ids, int64_t rows, const void* table, int64_t hidden,
           float* residual, cudaStream_t stream);

// residual [rows][hidden] float = table[ids[r] - vocab_begin] for ids in the shard
// [vocab_begin, vocab_begin + vocab_count) (table T [vocab_count][hidden]), zeros for others.
void embed_vocab_range(Dtype dt, const int32_t* ids, int64_t rows, const void* table,
                       int64_t hidden, int64_t vocab_begin, int64_t vocab_count, float* residual,
                       cudaStream_t stream);

// Where a row kernel also writes its T output quantized to e4m3 for an FP8 GEMM, by
// cuda_fp8.h's rule (quantize_rows_fp8 on the T values, bit for bit): q [rows][hidden] and one
// scale a row. Null q: no quantized copy.
struct Fp8Rows {
  uint8_t* q = nullptr;
  float* scale = nullptr;
};

// With delta != null first residual += delta (T [rows][hidden]); then
// out (T [rows][hidden]) = rmsnorm(residual) * weight (T [hidden]), float statistics, and
// out's e4m3 copy where fp8.q is set (out must then be set too).
// out may be null (residual update only).
void add_rms_norm(Dtype dt, float* residual, const void* delta, const void* weight, float eps,
                  int64_t rows, int64_t hidden, void* out, cudaStream_t stream, Fp8Rows fp8 = {});

// add_rms_norm with a float delta made of `parts` float [rows][hidden] slabs part_stride
// elements apart (delta + s * part_stride; part_stride % 4 == 0), summed in float32 in the
// order s = 0 .. parts - 1 and rounded to T once before the add (as a GEMM writing T rounds
// its float accumulator once): one part for all-reduced tensor-parallel partial sums, several
// for the K slices of a split-K GEMM (LtGemm::run_split_k).
void add_rms_norm_f32_delta(Dtype dt, float* residual, const float* delta, int32_t parts,
                            int64_t part_stride, const void* weight, float eps, int64_t rows,
                            int64_t hidden, void* out, cudaStream_t stream, Fp8Rows fp8 = {});

// Tensor parallel, peer to peer: one rank's view of the fused all-reduce below. In one process
// that owns every GPU with peer access enabled, a rank reads its peers' partial sums straight
// from their memory over NVLink, so a decode step's small all-reduces (rows x hidden floats)
// take one kernel instead of an NCCL collective plus the norm kernel.
inline constexpr int kMaxP2PRanks = 8;
// The kernel's fixed grid: block b of every rank meets block b of the others at a barrier of
// per-block flags, so every rank must launch the same number of blocks on every call.
inline constexpr int kP2PBlocks = 64;
struct P2PAllReduce {
  int32_t rank = 0;
  int32_t world = 1;
  // Every rank's float [rows][hidden] partial sums for this call (peer pointers). A rank must
  // not overwrite its buffer before every peer has read it: callers alternate two buffers,
  // and a rank starts call i + 1 only after every peer has started call i + 1 (the barrier),
  // so call i's reads are over before call i + 2 writes the same buffer.
  const float* deltas[kMaxP2PRanks] = {};
  // Rank s's barrier flags, uint32 [kP2PBlocks][kMaxP2PRanks] in its memory (zeroed once):
  // block b of rank r writes its call number to flags_s[b][r].
  uint32_t* flags[kMaxP2PRanks] = {};
  uint32_t* counters = nullptr;  // this rank's uint32 [kP2PBlocks] call numbers (zeroed once)
};

// All-reduce + add_rms_norm_f32_delta: residual += round_T(sum over ranks s = 0 .. world - 1,
// in that order, of deltas[s]), then out = rmsnorm(residual) * weight (out may be null), and
// out's e4m3 copy where fp8.q is set (as add_rms_norm's).
// Every rank computes the same sum in the same order, so the residual streams stay identical.
// A peer that never arrives (its rank failed) traps the kernel after ~10 s instead of hanging.
void p2p_all_reduce_add_rms_norm(Dtype dt, float* residual, const P2PAllReduce& ar,
                                 const void* weight, float eps, int64_t rows, int64_t hidden,
                                 void* out, cudaStream_t stream, Fp8Rows fp8 = {});

// out (float [n][hidden]) = src[rows[i]] (float [*][hidden]).
void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t hidden, float* out,
                 cudaStream_t stream);

// qkv T [rows][(nh + 2 nkv) * d] (q | k | v): RoPE (rotate-half, angle = position *
// inv_freq[i], inv_freq float [d/2]) on q and k; q goes to q_out T [rows][nh][d]; k and v go
// to the layer's pool (T [pages][nkv][page_size][d]) at slot kv_slots[r] (page * ps + slot).
// With k_scale and v_scale (float [pages][nkv][page_size]) the pools are e4m3: each (row, kv
// head) of K (rotated and rounded to T first) and of V is quantized with its own scale
// (models/fp8.h's fp8_kv_scale and quantize_fp8_kv_rows; d 64 or 128, as the CUDA backend
// requires), which goes to the scale arrays at the
// same (page, head, slot).
void rope_and_store_kv(Dtype dt, const void* qkv, const int32_t* positions, const float* inv_freq,
                       const int64_t* kv_slots, int64_t rows, int32_t nh, int32_t nkv, int32_t d,
                       int32_t page_size, void* q_out, void* k_pool, void* v_pool,
                       cudaStream_t stream, float* k_scale = nullptr, float* v_scale = nullptr);

// out T [rows][im] = silu(gu[:, :im]) * gu[:, im:]  (gu T [rows][2 im]).
// With fp8.q set, also out's e4m3 copy (as add_rms_norm's).
void swiglu(Dtype dt, const void* gu, int64_t rows, int64_t im, void* out, cudaStream_t stream,
            Fp8Rows fp8 = {});

// For every layer l (pools at k_all + l * layer_elems): slots [0, num_slots[i]) of page
// src[i] copied to page dst[i], every head. n copies. With k_scale_all and v_scale_all (float,
// one a row: [layers][pages][nkv][page_size]) the pools are e4m3 (a byte a value) and the rows'
// scales are copied too; likewise in move_slots.
void copy_pages(Dtype dt, void* k_all, void* v_all, int32_t layers, int64_t layer_elems,
                int64_t page_elems, int32_t nkv, int32_t page_size, int32_t d, const int32_t* src,
                const int32_t* dst, const int32_t* num_slots, int32_t n, cudaStream_t stream,
                float* k_scale_all = nullptr, float* v_scale_all = nullptr);

// Slot moves (speculative accept), sequentially in the given order: src/dst slot ids
// (page * ps + slot), every layer and head. One block does them in order (a later move may
// read an earlier one's destination).
void move_slots(Dtype dt, void* k_all, void* v_all, int32_t layers, int64_t layer_elems,
                int64_t page_elems, int32_t nkv, int32_t page_size, int32_t d, const int64_t* src,
                const int64_t* dst, int32_t n, cudaStream_t stream, float* k_scale_all = nullptr,
                float* v_scale_all = nullptr);

// Per row of logits (float [n][stride]): the argmax (lowest id on ties) over the row's first
// vocab entries (vocab <= stride; ids past a tokenizer's vocabulary are left out) and its
// log-softmax over those entries. scratch: argmax_scratch_bytes(n, vocab) of device memory.
size_t argmax_scratch_bytes(int64_t n, int64_t vocab);
void argmax_logprob(const float* logits, int64_t n, int64_t stride, int64_t vocab, int32_t* ids,
                    float* logprobs, void* scratch, cudaStream_t stream);

// Per row of a vocabulary shard's logits (float [n][stride]), over its first vocab entries
// (0 allowed): maxes[r], sums[r] = sum exp(x - max) (0 where every logit is -inf),
// ids[r] = id_offset + argmax (lowest on ties; INT32_MAX when vocab == 0). Shards merge to
// argmax_logprob's result: the largest max (lowest id on ties) and -log(sum_s sums[s] *
// exp(maxes[s] - max)).
void argmax_partial(const float* logits, int64_t n, int64_t stride, int64_t vocab,
                    int64_t id_offset, float* maxes, float* sums, int32_t* ids,
                    cudaStream_t stream);

// A checkpoint tensor's element type (models/safetensors.h's DType, without including it).
enum class SrcDtype : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// dst (T [n]) = src (src_dt [n]) rounded to T.
void convert_weights(Dtype dt, SrcDtype src_dt, const void* src, int64_t n, void* dst,
                     cudaStream_t stream);

// dst (T [rows][cols]) = fill_random's values of the block [row0, +rows) x [col0, +cols) of a
// [*][src_cols] matrix drawn with `seed` (each element hashes its index in the whole matrix).
void fill_random_block(Dtype dt, void* dst, int64_t rows, int64_t cols, uint64_t seed,
                       int64_t src_cols, int64_t row0, int64_t col0, float scale, float offset,
                       cudaStream_t stream);

// dst (T [n]) = src (float [n]).
void convert_from_f32(Dtype dt, const float* src, int64_t n, void* dst, cudaStream_t stream);

// dst (T [n]) = uniform(-scale, scale) from a hash of (seed, index): random weights for
// shape benchmarks without a checkpoint. With scale == 0, every element is `offset`.
void fill_random(Dtype dt, void* dst, int64_t n, uint64_t seed, float scale, float offset,
                 cudaStream_t stream);

}  // namespace treeserve::cuda
